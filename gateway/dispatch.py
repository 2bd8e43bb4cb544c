"""Into the fleet: check the workers a route needs, admission control, subscribe, enqueue.

`Dispatcher.submit` is the one way a prepared request enters the fleet. It owns
the connections the gateway's lifespan opens (Redis, the token relay, the
cached fleet view), the per-request hooks (timeline, SLO record, TTFT
calibration) every `Session` closes with, and the tenants' token budgets
(gateway/ratelimit.py), which the fleet client charges around `submit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass, field, replace

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from skyline.core import messages
from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys
from skyline.core.streams import Placement, enqueue, now_ms, release_backlog
from skyline.gateway.admission import apply_admission, learn
from skyline.gateway.errors import ApiError
from skyline.gateway.affinity import place_request
from skyline.gateway.fleetview import START_HINT, FleetView
from skyline.gateway.metrics import GatewayMetrics
from skyline.gateway.observe import GatewayObserver
from skyline.gateway.prepare import Prepared, Serving, needed_roles
from skyline.gateway.ratelimit import TokenBudgets
from skyline.gateway.relay import Relay, RelayUnavailable, Subscription
from skyline.gateway.session import Session
from skyline.scheduler.admission import TtftCalibration, stage_of
from skyline.scheduler.disagg import route


@dataclass
class Dispatcher:
    cfg: SkylineConfig
    serving: Serving
    keys: Keys
    metrics: GatewayMetrics
    observer: GatewayObserver
    calibration: TtftCalibration | None
    redis: aioredis.Redis | None = None  # set by the app's lifespan
    relay: Relay | None = None
    fleet: FleetView | None = None
    background: set[asyncio.Task] = field(default_factory=set)  # cancel publishes in flight
    budgets: TokenBudgets = field(default_factory=TokenBudgets)  # tenants' token budgets, in this process

    def __post_init__(self) -> None:
        self.admission_policy = self.cfg.admission_policy()
        self.affinity_policy = self.cfg.affinity_policy()

    async def submit(self, prep: Prepared) -> Session:
        """Check the fleet can serve the request, subscribe to its output, enqueue it."""
        fleet, r, cfg = self.fleet, self.redis, self.cfg
        if fleet is None or r is None or self.relay is None:
            raise ApiError(503, "the gateway is starting or stopping", code="not_ready")
        if not prep.route_fixed and prep.route == "disagg":
            # Queue depth is part of the route decision: re-decide with the cached prefill backlog.
            path = route(self.serving.policy, len(prep.request.prompt_token_ids), fleet.prefill_backlog_tokens)
            if path != prep.route:
                prep = replace(prep, route=path, request=replace(prep.request, route=path))
        missing = await fleet.missing(needed_roles(prep.route))
        if fleet.error:
            raise ApiError(503, f"the gateway cannot reach Redis ({fleet.error})", code="redis_unavailable")
        if missing:
            hint = " and ".join(f"`{START_HINT[role]}`" for role in missing)
            raise ApiError(503, f"no live {' or '.join(missing)} worker for the {prep.route} route; "
                                f"start one with {hint}", code="no_workers",
                           headers={"Retry-After": "1"})
        # Subscribe while admission control decides: the two round trips overlap. The request is
        # enqueued only once Redis confirmed the subscription, so no frame can be missed.
        subscribing = asyncio.ensure_future(self._subscribe(prep.request.request_id))
        try:
            if cfg.gateway.admission:
                try:
                    prep = await apply_admission(cfg, self.admission_policy, r, self.keys, fleet, prep, self.metrics,
                                                 self.calibration)
                except (RedisError, OSError) as exc:
                    raise ApiError(503, f"the gateway cannot reach Redis ({exc})", code="redis_unavailable") from None
        except BaseException:
            self._drop_subscription(subscribing)
            raise
        try:
            return await self._enqueue(prep, await subscribing)
        except Exception:  # an ApiError, or a message that does not encode (an internal error)
            if cfg.gateway.admission:  # the reservation made by admission control is void
                with contextlib.suppress(RedisError, OSError):
                    await release_backlog(r, self.keys, stage_of(prep.route), prep.request.tier,
                                          len(prep.request.prompt_token_ids))
            raise

    async def _subscribe(self, request_id: str) -> Subscription:
        assert self.relay is not None
        try:
            return await self.relay.subscribe(request_id)
        except RelayUnavailable as exc:
            raise ApiError(503, str(exc), code="relay_unavailable") from None

    def _drop_subscription(self, subscribing: asyncio.Future) -> None:
        """The request was refused while its subscription was on its way: take it back."""
        if not subscribing.done():
            subscribing.cancel()  # Relay.subscribe unsubscribes what it sent
        elif not subscribing.cancelled() and subscribing.exception() is None:
            assert self.relay is not None
            self.relay.unsubscribe(subscribing.result())

    async def _place(self, stage: str, prep: Prepared) -> Placement | None:
        """Where the prompt's prefix is cached (gateway/affinity.py); None: the shared queue."""
        assert self.redis is not None and self.fleet is not None
        return await place_request(self.affinity_policy, self.cfg.gateway.affinity_max_blocks, self.redis, self.keys,
                                   self.fleet.workers, stage, prep.request)

    async def _enqueue(self, prep: Prepared, sub: Subscription) -> Session:
        relay, r = self.relay, self.redis
        assert relay is not None and r is not None
        session = Session(prep, sub, relay, r, self.keys, self.cfg.gateway, self.metrics, self.background)
        session.on_close.append(self.observer.closed)
        if self.calibration is not None:
            session.on_close.append(functools.partial(learn, self.calibration))
        if prep.route == "disagg":
            stage, msg = "prefill", prep.request
        else:
            stage, msg = "decode", messages.DecodeWork(request=prep.request, kv_handle=None)
        try:
            session.placement = await self._place(stage, prep)
            session.t_enqueue_ms = now_ms()  # before the XADD: no worker's claim can look earlier
            await enqueue(r, self.keys, stage, msg, self.cfg.redis.stream_maxlen,
                          backlog_reserved=self.cfg.gateway.admission, placement=session.placement)
            session.t_enqueued = time.perf_counter()
        except (RedisError, OSError) as exc:
            session.finished = True  # never enqueued: nothing to cancel
            session.close(503)
            raise ApiError(503, f"could not enqueue the request: {exc}", code="redis_unavailable") from None
        except Exception:  # the message did not encode: never enqueued, and its subscription must go
            session.finished = True
            session.close(500)
            raise
        return session
