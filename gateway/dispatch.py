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
from skyline.core.keys import STAGES, Keys
from skyline.core.streams import Reservation, backlog_seen, enqueue, now_ms, queue_reservation, release_backlog
from skyline.gateway import adapters
from skyline.gateway.admission import apply_admission, learn
from skyline.gateway.errors import ApiError
from skyline.gateway.affinity import CacheMatch, PlacedInFlight, look_up, placement
from skyline.gateway.fleetview import START_HINT, ModelView
from skyline.gateway.metrics import GatewayMetrics
from skyline.gateway.observe import GatewayObserver
from skyline.gateway.prepare import Prepared, Serving, needed_stages
from skyline.gateway.ratelimit import TokenBudgets
from skyline.gateway.relay import Relay, RelayUnavailable, Subscription
from skyline.gateway.session import Session
from skyline.scheduler.admission import TtftCalibration, handoff_wait_ms, pool_rate, prefill_is_faster, stage_of
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
    fleet: ModelView | None = None  # its model's workers (gateway/fleetview.py)
    background: set[asyncio.Task] = field(default_factory=set)  # cancel publishes in flight
    budgets: TokenBudgets = field(default_factory=TokenBudgets)  # tenants' token budgets, in this process

    def __post_init__(self) -> None:
        self.admission_policy = self.cfg.admission_policy()
        self.affinity_policy = self.cfg.affinity_policy()
        self.adapter_policy = adapters.adapter_policy(self.cfg.gateway)
        self.placed = PlacedInFlight()  # placed requests not ended yet, by worker: load heartbeats lag behind

    async def submit(self, prep: Prepared) -> Session:
        """Check the fleet can serve the request, subscribe to its output, enqueue it.

        Two round trips to Redis after rendering: one that reads the fleet's prefix caches
        and the backlog while reserving the prompt in it (the subscription to the token
        channel is confirmed meanwhile, on the relay's connection), one that enqueues it.
        The request is enqueued only once Redis confirmed the subscription, so no frame can
        be missed."""
        fleet, r = self.fleet, self.redis
        if fleet is None or r is None or self.relay is None:
            raise ApiError(503, "the gateway is starting or stopping", code="not_ready")
        subscribing = asyncio.ensure_future(self._subscribe(prep.request.request_id))
        reserved: Reservation | None = None
        try:
            match, backlog, reserved = await self._read_fleet(prep)
            prep = await self._decide(prep, match, backlog, reserved)
            return await self._enqueue(prep, await subscribing, reserved)
        except BaseException:
            self._drop_subscription(subscribing)
            self.placed.done(prep.request.request_id)  # refused: it loads nobody
            if reserved is not None:  # admission control's reservation is void
                with contextlib.suppress(RedisError, OSError):
                    await release_backlog(r, self.keys, reserved.stage, reserved.tier, reserved.tokens)
            raise

    async def _read_fleet(self, prep: Prepared) -> tuple[CacheMatch | None, dict | None, Reservation | None]:
        """One round trip: what the workers' engines hold of the prompt (None: no worker reports a
        prefix cache), and, with admission control on, the backlog as read right after the prompt
        was reserved in it (the stage of the route its length gives; `_decide` may move it)."""
        fleet, r, cfg = self.fleet, self.redis, self.cfg
        assert fleet is not None and r is not None
        req = prep.request
        # With prefix affinity off the gateway is blind to the caches: no placement, and the route and
        # admission count the whole prompt (the baseline `skyline bench`'s *-no-affinity systems measure).
        look = look_up(fleet.workers, req, cfg.gateway.affinity_max_blocks) if cfg.gateway.prefix_affinity else None
        reserving = Reservation(stage_of(prep.route), req.tier, len(req.prompt_token_ids)) \
            if cfg.gateway.admission else None
        pipe = r.pipeline(transaction=False)
        n_look = look.queue(pipe, self.keys) if look is not None else 0
        if reserving is not None:
            queue_reservation(pipe, self.keys, reserving)
        try:
            replies = await pipe.execute() if len(pipe) else []
        except (RedisError, OSError) as exc:  # whether the reservation was made is unknown: never released
            raise ApiError(503, f"the gateway cannot reach Redis ({exc})", code="redis_unavailable") from None
        match = look.result(replies[:n_look]) if look is not None else None
        return match, (replies[-1] if reserving is not None else None), reserving

    async def _decide(self, prep: Prepared, match: CacheMatch | None, backlog: dict | None,
                      reserved: Reservation | None) -> Prepared:
        """The request as it will be enqueued: its route, placement and admission (an ApiError when the
        fleet cannot take it)."""
        fleet, cfg = self.fleet, self.cfg
        assert fleet is not None
        if not prep.route_fixed:
            path = self._route(prep, match, backlog, reserved)
            if path != prep.route:
                prep = replace(prep, route=path, request=replace(prep.request, route=path))
        prep = self._placed(prep, match)
        missing = await fleet.missing(needed_stages(prep.route))
        if fleet.error:
            raise ApiError(503, f"the gateway cannot reach Redis ({fleet.error})", code="redis_unavailable")
        if missing:
            hint = " and ".join(f"`{START_HINT[stage]}`" for stage in missing)
            raise ApiError(503, f"no live {' or '.join(missing)} worker of model {self.serving.served_model!r} for "
                                f"the {prep.route} route; start one with {hint}", code="no_workers",
                           headers={"Retry-After": "1"})
        if backlog is not None:
            seen = backlog_seen(backlog, stage_of(prep.route), reserved)
            handoff = handoff_wait_ms(self.admission_policy, cfg.tiers, prep.request.tier,
                                      backlog_seen(backlog, "decode", reserved),
                                      pool_rate(fleet.workers, "decode")) if prep.route == "disagg" else 0.0
            # A request whose adapter no engine of its stage holds waits for one to load it.
            handoff += adapters.load_wait(self.adapter_policy, fleet.workers, stage_of(prep.route), prep.request)
            prep = apply_admission(cfg, self.admission_policy, fleet, prep, seen, self.metrics, self.calibration,
                                   handoff)
        return prep

    def _route(self, prep: Prepared, match: CacheMatch | None, backlog: dict | None,
               reserved: Reservation | None) -> str:
        """The route (scheduler/disagg.py), decided on what each stage has left to compute and queued.
        The prefix caches count: a prompt whose decode worker holds most of it has only its new tokens
        to compute, and skips the prefill pool as a short prompt does. So do the queues (with admission
        control on, the backlog was read for it): a short prompt goes to the prefill pool when the
        decode workers have prompts queued ahead of it and the prefill pool is predicted faster."""
        fleet, cfg = self.fleet, self.cfg
        assert fleet is not None
        n = len(prep.request.prompt_token_ids)
        left = match.best_uncached("decode") if match else n
        faster = None
        if backlog is not None and fleet.stages.get("prefill"):
            def faster() -> bool:
                seen = {stage: backlog_seen(backlog, stage, reserved) for stage in STAGES}
                rates = {stage: pool_rate(fleet.workers, stage) for stage in STAGES}
                return prefill_is_faster(self.admission_policy, cfg.tiers, prep.request.tier,
                                         match.best_uncached("prefill") if match else n, left, seen, rates,
                                         self.calibration)
        return route(self.serving.policy, left, fleet.prefill_backlog_tokens, faster)

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
        if prep.request.adapter is not None:  # placed by its adapter: no prefix view holds adapter blocks
            assert self.fleet is not None
            return replace(prep, placement=adapters.placement(self.adapter_policy, self.fleet.workers,
                                                              stage_of(prep.route), prep.request, self.placed))
        if match is None:
            return prep
        stage = stage_of(prep.route)
        assert self.fleet is not None
        placed = placement(self.affinity_policy, match, stage, prep.request, self.placed,
                           pool_rate(self.fleet.workers, stage))
        ids = match.stage(stage).ids
        worker = placed.worker if placed else ids[0] if len(ids) == 1 else None
        return replace(prep, placement=placed, uncached_tokens=match.uncached_tokens(worker))

    async def _enqueue(self, prep: Prepared, sub: Subscription, reserved: Reservation | None) -> Session:
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
            await enqueue(r, self.keys, stage, msg, self.cfg.redis.stream_maxlen, reserved=reserved,
                          placement=prep.placement, prefill_tokens=prep.prefill_tokens)
            session.t_enqueued = time.perf_counter()
        except (RedisError, OSError) as exc:
            session.finished = True  # never enqueued: nothing to cancel
            session.close(503)
            err = ApiError(503, f"could not enqueue the request: {exc}", code="redis_unavailable")
            err.recorded = True
            raise err from None
        except Exception:  # the message did not encode: never enqueued, and its subscription must go
            session.finished = True
            session.close(500)
            raise
        return session
