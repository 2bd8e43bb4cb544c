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
from skyline.core.streams import enqueue, now_ms, release_backlog
from skyline.gateway.admission import apply_admission, learn
from skyline.gateway.errors import ApiError
from skyline.gateway.affinity import CacheMatch, PlacedInFlight, look_up, placement
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
        self.placed = PlacedInFlight()  # placed requests not ended yet, by worker: load heartbeats lag behind

    async def submit(self, prep: Prepared) -> Session:
        """Check the fleet can serve the request, subscribe to its output, enqueue it."""
        fleet, r, cfg = self.fleet, self.redis, self.cfg
        if fleet is None or r is None or self.relay is None:
            raise ApiError(503, "the gateway is starting or stopping", code="not_ready")
        try:
            match = await look_up(r, self.keys, fleet.workers, prep.request, cfg.gateway.affinity_max_blocks)
        except (RedisError, OSError) as exc:
            raise ApiError(503, f"the gateway cannot reach Redis ({exc})", code="redis_unavailable") from None
        if not prep.route_fixed and prep.route == "disagg":
            # Queue depth and the decode pool's prefix caches are part of the route decision: a prompt
            # whose decode worker holds most of it has only its new tokens to compute, and skips the
            # prefill pool as a short prompt does.
            left = match.best_uncached("decode") if match else len(prep.request.prompt_token_ids)
            path = route(self.serving.policy, left, fleet.prefill_backlog_tokens)
            if path != prep.route:
                prep = replace(prep, route=path, request=replace(prep.request, route=path))
        prep = self._placed(prep, match)
        try:
            return await self._admit_and_enqueue(prep)
        except BaseException:
            self.placed.done(prep.request.request_id)  # refused: it loads nobody
            raise

    async def _admit_and_enqueue(self, prep: Prepared) -> Session:
        fleet, r, cfg = self.fleet, self.redis, self.cfg
        assert fleet is not None and r is not None
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
                                          prep.prefill_tokens)
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

    def _placed(self, prep: Prepared, match: CacheMatch | None) -> Prepared:
        """The worker to wait for (gateway/affinity.py), and what its engine has left to compute: the
        placed worker's, or the only worker's of the stage; otherwise unknown (all of the prompt)."""
        if match is None:
            return prep
        stage = stage_of(prep.route)
        placed = placement(self.affinity_policy, match, stage, prep.request, self.placed)
        holders = match.holders(stage)
        worker = placed.worker if placed else holders[0].worker if len(holders) == 1 else None
        return replace(prep, placement=placed, uncached_tokens=match.uncached_tokens(worker))

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
        session.placement = prep.placement
        if prep.placement is not None:
            session.on_close.append(lambda *_: self.placed.done(prep.request.request_id))
        try:
            session.t_enqueue_ms = now_ms()  # before the XADD: no worker's claim can look earlier
            await enqueue(r, self.keys, stage, msg, self.cfg.redis.stream_maxlen,
                          backlog_reserved=self.cfg.gateway.admission, placement=prep.placement,
                          prefill_tokens=prep.prefill_tokens)
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
