"""The token relay: one Redis pub/sub connection per gateway process, one reader task.

Each in-flight request subscribes to its channel `keys.tokens(request_id)`;
the reader task parses everything the connection delivers and drops each frame
into that request's bounded queue. Why one connection and not a PubSub object
per request: thousands of concurrent requests would otherwise mean thousands
of Redis connections and reader tasks.

Guarantees the rest of the gateway relies on:
- `subscribe()` returns only after Redis confirmed the subscription, so the
  request can be enqueued knowing that no frame a worker publishes is lost.
- Frames are decoded here (`skyline.core.messages.decode`); a TokenDelta/Finished
  whose `seq` is not newer than the last one seen is a duplicate (a worker
  re-published after a reclaim) and is dropped. Failed frames always pass.
- If the connection breaks, in-flight requests are kept for up to
  `redis.outage_grace_s` while the reader reconnects: once Redis confirmed
  their subscriptions again, each is caught up from its frame log, from the
  frame after the last one it delivered (gateway/resume.py), so a Redis
  restart with persistence, or a dropped connection, costs its clients a
  pause and nothing else. A request Redis lost the state of (no persistence),
  or one still waiting when the grace is over, receives a Failed frame (502,
  `redis_state_lost` / `relay_disconnected`): silence would leave it hanging.
  With a grace of 0 every in-flight request fails at once. While the
  connection is down `subscribe()` raises `RelayUnavailable` (the gateway
  answers 503).

The client speaks RESP2 itself, on a plain asyncio stream, rather than through
redis-py: redis-py's pub/sub silently reconnects and re-subscribes (losing
frames without telling anyone) and parses one reply per await; here a single
`read()` may yield many frames, which is what keeps the hot path cheap.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from redis.exceptions import RedisError

from skyline.core import messages, redisconn
from skyline.core.config import RedisConfig
from skyline.core.keys import Keys
from skyline.core.redisconn import Endpoint, describe, pubsub_endpoints
from skyline.gateway import resp, resume

log = logging.getLogger("skyline.gateway.relay")


class RelayUnavailable(Exception):
    """The pub/sub connection is down or did not confirm a subscription in time."""


class Subscription:
    """The frames of one request, in order, without duplicates.

    `aborted` is set when the gateway itself ended the request (lost
    connection, client too slow to read): the workers do not know yet, so the
    caller should cancel the request. `held` is not None while the relay is
    reconnecting: frames that arrive then wait there until the frames logged
    meanwhile have been delivered (`resume`).
    """

    __slots__ = ("aborted", "channel", "done", "duplicates", "held", "last_seq", "queue", "request_id")

    def __init__(self, request_id: str, channel: bytes, maxsize: int):
        self.request_id = request_id
        self.channel = channel
        self.queue: asyncio.Queue[messages.Message] = asyncio.Queue(maxsize)
        self.last_seq = -1
        self.done = False  # a terminal frame (Finished/Failed) was queued; ignore the rest
        self.aborted = False
        self.duplicates = 0
        self.held: list[messages.Message] | None = None

    async def get(self) -> messages.Message:
        return await self.queue.get()

    def get_nowait(self) -> messages.Message | None:
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def offer(self, frame: messages.Message) -> None:
        """Queue a frame from the wire (called by the reader task only)."""
        if self.done:
            return
        if self.held is not None:
            if len(self.held) >= self.queue.maxsize:
                self.fail(502, "too many frames arrived while the gateway caught this request up after "
                               "losing Redis; request aborted", "relay_disconnected")
                return
            self.held.append(frame)
            return
        if not isinstance(frame, messages.Failed):
            seq = getattr(frame, "seq", None)
            if seq is None:
                return  # not an output frame (e.g. a Cancel published on the wrong channel)
            if seq <= self.last_seq:
                self.duplicates += 1
                return
            self.last_seq = seq
        if isinstance(frame, (messages.Finished, messages.Failed)):
            self.done = True
        try:
            self.queue.put_nowait(frame)
        except asyncio.QueueFull:
            # The client reads slower than the engine writes and the buffer is full.
            # Dropping frames would corrupt the output; end the request instead.
            self.fail(503, "the client did not read the output fast enough; request aborted", "client_too_slow")

    def hold(self) -> None:
        """The connection is lost: hold live frames until the request has been caught up."""
        if self.held is None and not self.done:
            self.held = []

    def resume(self, logged: list[messages.Message]) -> None:
        """Deliver the frames logged while the connection was down, then those held back, in
        frame order; what was delivered already, or is both logged and held, is dropped by seq."""
        held, self.held = self.held or [], None
        for frame in sorted([*logged, *held], key=_frame_order):
            self.offer(frame)

    def fail(self, status: int, message: str, code: str) -> None:
        """End the request from the gateway side: replace whatever is queued by one Failed frame."""
        self.held = None
        if self.done and self.aborted:
            return
        while not self.queue.empty():
            self.queue.get_nowait()
        self.done = self.aborted = True
        self.queue.put_nowait(messages.Failed(self.request_id, 1 << 30, status, message, "server_error", code))


def _frame_order(frame: messages.Message) -> int:
    return getattr(frame, "seq", 1 << 30)  # a worker's Failed outside the publish script has seq 2**30


class Relay:
    """One pub/sub connection shared by every request of this gateway process."""

    def __init__(
        self,
        redis: RedisConfig | str,
        keys: Keys,
        *,
        queue_size: int = 4096,
        confirm_timeout_s: float = 5.0,
        ping_interval_s: float = 5.0,
        resume_s: float | None = None,
    ):
        # A Redis URL or the whole RedisConfig (credentials, TLS files, cluster or Sentinel).
        self.redis_cfg = redis if isinstance(redis, RedisConfig) else RedisConfig(url=redis)
        # How long in-flight requests wait for a lost connection to come back (None: the config's).
        self.resume_s = self.redis_cfg.outage_grace_s if resume_s is None else resume_s
        self.url = describe(self.redis_cfg)  # for messages: no password
        self.keys = keys
        self.queue_size = queue_size
        self.confirm_timeout_s = confirm_timeout_s
        self.ping_interval_s = ping_interval_s
        self.client_name = f"{keys.prefix}-gateway-relay-{os.getpid()}"
        self._subs: dict[bytes, Subscription] = {}
        self._confirms: dict[bytes, asyncio.Future[None]] = {}
        self._unsub_pending: list[bytes] = []
        self._writer: asyncio.StreamWriter | None = None
        self._connected = asyncio.Event()
        self._closing = False
        self._last_rx = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        # Resuming after a lost connection: a plain client reads the frame logs and the epoch
        # (the pub/sub connection cannot run other commands once it subscribes).
        self._r = None
        self._epoch: bytes | None = None  # keys.epoch as read at the last connect
        self._resume_task: asyncio.Task | None = None
        self._grace_timer: asyncio.TimerHandle | None = None
        self._lost_reason = ""

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start the reader; return once connected (raises RelayUnavailable otherwise)."""
        self._r = redisconn.connect(self.redis_cfg)
        self._tasks = [asyncio.create_task(self._run(), name="relay-reader"),
                       asyncio.create_task(self._watchdog(), name="relay-watchdog")]
        try:
            async with asyncio.timeout(timeout_s):
                await self._connected.wait()
        except TimeoutError:
            await self.close()
            raise RelayUnavailable(f"could not connect the token relay to Redis at {self.url}") from None

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._drop_connection("the gateway is shutting down", status=503)
        self._end_grace()
        if self._r is not None:
            await self._r.aclose()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._subs)

    # ---- per request -----------------------------------------------------------------

    async def subscribe(self, request_id: str) -> Subscription:
        """Listen to a request's token channel; returns after Redis confirmed it."""
        if not self._connected.is_set():
            raise RelayUnavailable("the gateway's Redis pub/sub connection is down")
        channel = self.keys.tokens(request_id).encode()
        sub = Subscription(request_id, channel, self.queue_size)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._subs[channel] = sub
        self._confirms[channel] = fut
        try:
            self._send(b"SUBSCRIBE", channel)
            async with asyncio.timeout(self.confirm_timeout_s):
                await fut
        except BaseException as exc:
            self._subs.pop(channel, None)
            self._confirms.pop(channel, None)
            if self._connected.is_set():  # do not leave a subscription behind in Redis
                self._unsub_pending.append(channel)
                if len(self._unsub_pending) == 1:
                    asyncio.get_running_loop().call_soon(self._flush_unsubscribes)
            if isinstance(exc, (TimeoutError, OSError, RelayUnavailable)):
                raise RelayUnavailable(f"Redis did not confirm the subscription to {channel.decode()}") from exc
            raise
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop listening. Batched: one UNSUBSCRIBE per loop iteration for all finished requests."""
        if self._subs.pop(sub.channel, None) is None:
            return
        self._unsub_pending.append(sub.channel)
        if len(self._unsub_pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush_unsubscribes)

    def _flush_unsubscribes(self) -> None:
        channels, self._unsub_pending = self._unsub_pending, []
        if channels and self._connected.is_set():
            try:
                self._send(b"UNSUBSCRIBE", *channels)
            except (OSError, RelayUnavailable):
                pass  # the connection is gone, and with it the subscriptions

    # ---- connection ------------------------------------------------------------------

    def _send(self, *parts: bytes) -> None:
        writer = self._writer
        if writer is None or writer.is_closing():
            raise RelayUnavailable("the gateway's Redis pub/sub connection is down")
        writer.write(resp.pack(parts))
        # No drain(): commands are tiny, and the reader keeps the socket flowing;
        # transport buffering is bounded by the number of in-flight requests.

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            reason = "Redis closed the connection"
            try:
                reader = await self._connect()
                backoff = 0.05
                self._resume_task = asyncio.create_task(self._resume(), name="relay-resume")
                await self._read_loop(reader)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means the same: reconnect
                reason = f"{type(exc).__name__}: {exc}"
            self._drop_connection(reason)
            if self._closing:
                return
            log.warning("token relay lost Redis (%s); reconnecting", reason)
            await asyncio.sleep(backoff)
            # Streams wait while requests are held: try often; else back off further.
            backoff = min(backoff * 2, 0.5 if self._grace_timer is not None else 2.0)

    async def _connect(self) -> asyncio.StreamReader:
        """Connect to the first endpoint that answers: the server, the master Sentinel reports
        now, or in a cluster the node serving the `{decode}` slot (decode workers publish
        token frames from scripts there, and PUBLISH's receiver count, by which they notice
        a departed client, only counts that node's subscribers), else any other node."""
        last: Exception = ConnectionError(f"no Redis endpoint for {self.url}")
        for ep in await pubsub_endpoints(self.redis_cfg, near_key=self.keys.stream("decode", "relay")):
            try:
                return await self._open(ep)
            except (OSError, ConnectionError, TimeoutError) as exc:
                log.warning("token relay: cannot use %s: %s", ep, exc)
                last = exc
        raise last

    async def _open(self, ep: Endpoint) -> asyncio.StreamReader:
        if ep.unix_path:
            reader, writer = await asyncio.open_unix_connection(ep.unix_path)
        else:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(ep.host, ep.port, ssl=ep.tls), timeout=5.0)
        hello: list[tuple[bytes, ...]] = []
        if ep.password:
            hello.append((b"AUTH", ep.username.encode(), ep.password.encode()) if ep.username
                         else (b"AUTH", ep.password.encode()))
        hello.append((b"CLIENT", b"SETNAME", self.client_name.encode()))
        for cmd in hello:
            writer.write(resp.pack(cmd))
        buf = bytearray()
        for cmd in hello:
            reply = await resp.read_one(reader, buf)
            if isinstance(reply, resp.RespError):
                writer.close()
                raise ConnectionError(f"{cmd[0].decode()} failed: {reply}")
        self._writer = writer
        self._last_rx = time.monotonic()
        self._pending_buf = buf
        self._connected.set()
        log.info("token relay connected to Redis as %s", self.client_name)
        return reader

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        buf = self._pending_buf
        while True:
            pos = 0
            while True:
                parsed = resp.parse(buf, pos)
                if parsed is None:
                    break
                item, pos = parsed
                self._dispatch(item)
            del buf[:pos]
            data = await reader.read(1 << 16)
            if not data:
                return  # EOF
            self._last_rx = time.monotonic()
            buf += data

    def _dispatch(self, item: object) -> None:
        if isinstance(item, list) and item:
            kind = item[0]
            if kind == b"message":
                sub = self._subs.get(item[1])
                if sub is None:
                    return  # finished and unsubscribed; late frame
                try:
                    frame = messages.decode(item[2])
                except messages.CodecError as exc:
                    log.warning("undecodable frame on %s: %s", item[1], exc)
                    return
                sub.offer(frame)
            elif kind == b"subscribe":
                fut = self._confirms.pop(item[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            # unsubscribe confirmations and pongs need nothing
        elif isinstance(item, resp.RespError):
            log.error("Redis refused a relay command: %s", item)
            self._fail_confirms(RelayUnavailable(f"Redis refused SUBSCRIBE: {item}"))

    def _fail_confirms(self, exc: Exception) -> None:
        confirms, self._confirms = self._confirms, {}
        for fut in confirms.values():
            if not fut.done():
                fut.set_exception(exc)

    def _drop_connection(self, reason: str, status: int = 502) -> None:
        """Close the connection. In-flight requests are held for the grace (`_resume` catches
        them up once the connection is back); without one, or when closing, they fail now."""
        self._connected.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._resume_task is not None:
            self._resume_task.cancel()
            self._resume_task = None
        self._fail_confirms(RelayUnavailable(f"token relay lost Redis: {reason}"))
        self._unsub_pending = []
        if self._closing or self.resume_s <= 0:
            self._fail_all(status, f"the gateway lost its Redis pub/sub connection ({reason}); "
                                   "this request's output could not be delivered", reason)
            return
        for sub in self._subs.values():
            sub.hold()
        if self._grace_timer is None and self._subs:
            self._lost_reason = reason
            self._grace_timer = asyncio.get_running_loop().call_later(self.resume_s, self._grace_over)
            log.warning("token relay lost Redis (%s); holding %d in-flight request(s) for up to %g s",
                        reason, len(self._subs), self.resume_s)

    def _fail_all(self, status: int, message: str, reason: str) -> None:
        """Fail every in-flight request; their subscriptions went with the connection."""
        subs, self._subs = self._subs, {}
        for sub in subs.values():
            sub.fail(status, message, "relay_disconnected")
        if subs:
            log.log(logging.ERROR if status == 502 else logging.WARNING,
                    "token relay: failed %d in-flight request(s): %s", len(subs), reason)

    def _grace_over(self) -> None:
        """The connection did not come back (or the catch-up did not complete) in time. The failed
        requests stay in `_subs` until their sessions unsubscribe: a catch-up in progress may
        have subscribed them again, and the session's unsubscribe is what undoes that."""
        self._grace_timer = None
        held = [s for s in self._subs.values() if s.held is not None]
        for sub in held:
            sub.fail(502, f"the gateway lost its Redis pub/sub connection ({self._lost_reason}) and it was not "
                          f"back within {self.resume_s:g} s; this request's output could not be delivered",
                     "relay_disconnected")
        if held:
            log.error("token relay: failed %d in-flight request(s): not reconnected within %g s",
                      len(held), self.resume_s)

    def _end_grace(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None

    async def _resume(self) -> None:
        """After (re)connecting: read the epoch, re-subscribe the held requests, catch each up
        from its frame log (gateway/resume.py). Cancelled if the connection drops again; the
        held requests then wait for the next connection, within the same grace."""
        try:
            kept, self._epoch = await self._retrying(lambda: resume.check_epoch(self._r, self.keys, self._epoch))
            held = [s for s in self._subs.values() if s.held is not None]
            if not held:
                self._end_grace()
                return
            if kept is False:
                self._fail_lost(held, resume.DATA_LOST)  # queued ones too: their entries are gone
                self._end_grace()
                return
            loop = asyncio.get_running_loop()
            confirms = []
            for sub in held:
                fut: asyncio.Future[None] = loop.create_future()
                self._confirms[sub.channel] = fut
                confirms.append(fut)
            for i in range(0, len(held), 512):  # one confirmation per channel comes back
                self._send(b"SUBSCRIBE", *(s.channel for s in held[i:i + 512]))
            async with asyncio.timeout(self.confirm_timeout_s):
                await asyncio.gather(*confirms)
            held = [s for s in held if s.held is not None and self._subs.get(s.channel) is s]  # still wanted
            states = await self._retrying(
                lambda: resume.read_logged(self._r, self.keys, [(s.request_id, s.last_seq) for s in held]))
            lost = 0
            for sub, state in zip(held, states):
                why = resume.verdict(sub.last_seq, kept, state)
                if why is not None:
                    self._fail_lost([sub], why)
                    lost += 1
                else:
                    sub.resume(_decode_all(state.frames, sub.channel))
            self._end_grace()
            log.info("token relay: resumed %d in-flight request(s) after reconnecting%s", len(held) - lost,
                     f"; {lost} had lost their state" if lost else "")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, a new connection starts over
            if isinstance(exc, (RelayUnavailable, TimeoutError, OSError)):  # not confirmed in time, or gone
                log.warning("token relay: resuming failed (%s); reconnecting", exc)
            else:
                log.exception("token relay: resuming failed; reconnecting")
            if self._writer is not None:
                self._writer.transport.abort()

    def _fail_lost(self, subs: list[Subscription], why: str) -> None:
        """Requests whose state Redis lost (they stay in `_subs` until their sessions unsubscribe)."""
        for sub in subs:
            sub.fail(502, f"{why}: this request's output cannot be completed; retry the request",
                     resume.STATE_LOST)
        log.error("token relay: %d in-flight request(s) lost their state in Redis: %s", len(subs), why)

    async def _retrying(self, call):
        """A read on the plain client, retried while Redis does not answer it yet (e.g. LOADING its
        AOF: the pub/sub connection may be back before the data). Ends when it succeeds or the
        connection drops again (the task is cancelled); held requests are bounded by the grace."""
        pause = 0.05
        while True:
            try:
                return await call()
            except (RedisError, OSError) as exc:
                if pause == 0.05:
                    log.warning("token relay: Redis does not answer reads yet (%s); retrying", exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

    async def _watchdog(self) -> None:
        """PING periodically; a connection silent for 3 periods is dead (e.g. the host vanished
        without closing TCP) and is closed: the reader holds in-flight requests and reconnects."""
        while True:
            await asyncio.sleep(self.ping_interval_s)
            if not self._connected.is_set() or self._writer is None:
                continue
            if time.monotonic() - self._last_rx > 3 * self.ping_interval_s:
                log.error("token relay: no reply from Redis for %.0f s; reconnecting", 3 * self.ping_interval_s)
                self._writer.transport.abort()
                continue
            try:
                self._send(b"PING")
            except (OSError, RelayUnavailable):
                pass


def _decode_all(payloads: list[bytes], channel: bytes) -> list[messages.Message]:
    frames = []
    for payload in payloads:
        try:
            frames.append(messages.decode(payload))
        except messages.CodecError as exc:
            log.warning("undecodable logged frame of %s: %s", channel, exc)
    return frames
