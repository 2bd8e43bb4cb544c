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
- If the connection breaks, every in-flight request receives a Failed frame
  (502) at once: the frames published meanwhile are lost, and silence would
  leave clients hanging. The reader then reconnects with backoff; while it is
  down `subscribe()` raises `RelayUnavailable` (the gateway answers 503).

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

from skyline.core import messages
from skyline.core.config import RedisConfig
from skyline.core.keys import Keys
from skyline.core.redisconn import Endpoint, describe, pubsub_endpoints

log = logging.getLogger("skyline.gateway.relay")


class RelayUnavailable(Exception):
    """The pub/sub connection is down or did not confirm a subscription in time."""


class Subscription:
    """The frames of one request, in order, without duplicates.

    `aborted` is set when the gateway itself ended the request (lost
    connection, client too slow to read): the workers do not know yet, so the
    caller should cancel the request.
    """

    __slots__ = ("aborted", "channel", "done", "duplicates", "last_seq", "queue", "request_id")

    def __init__(self, request_id: str, channel: bytes, maxsize: int):
        self.request_id = request_id
        self.channel = channel
        self.queue: asyncio.Queue[messages.Message] = asyncio.Queue(maxsize)
        self.last_seq = -1
        self.done = False  # a terminal frame (Finished/Failed) was queued; ignore the rest
        self.aborted = False
        self.duplicates = 0

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

    def fail(self, status: int, message: str, code: str) -> None:
        """End the request from the gateway side: replace whatever is queued by one Failed frame."""
        if self.done and self.aborted:
            return
        while not self.queue.empty():
            self.queue.get_nowait()
        self.done = self.aborted = True
        self.queue.put_nowait(messages.Failed(self.request_id, 1 << 30, status, message, "server_error", code))


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
    ):
        # A Redis URL or the whole RedisConfig (credentials, TLS files, cluster or Sentinel).
        self.redis_cfg = redis if isinstance(redis, RedisConfig) else RedisConfig(url=redis)
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

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start the reader; return once connected (raises RelayUnavailable otherwise)."""
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
        writer.write(_pack(parts))
        # No drain(): commands are tiny, and the reader keeps the socket flowing;
        # transport buffering is bounded by the number of in-flight requests.

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            reason = "Redis closed the connection"
            try:
                reader = await self._connect()
                backoff = 0.05
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
            backoff = min(backoff * 2, 2.0)

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
            writer.write(_pack(cmd))
        buf = bytearray()
        for cmd in hello:
            reply = await _read_one(reader, buf)
            if isinstance(reply, RespError):
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
                parsed = _parse(buf, pos)
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
        elif isinstance(item, RespError):
            log.error("Redis refused a relay command: %s", item)
            self._fail_confirms(RelayUnavailable(f"Redis refused SUBSCRIBE: {item}"))

    def _fail_confirms(self, exc: Exception) -> None:
        confirms, self._confirms = self._confirms, {}
        for fut in confirms.values():
            if not fut.done():
                fut.set_exception(exc)

    def _drop_connection(self, reason: str, status: int = 502) -> None:
        """Close the connection and fail every in-flight request: their frames are lost."""
        self._connected.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._fail_confirms(RelayUnavailable(f"token relay lost Redis: {reason}"))
        subs, self._subs = self._subs, {}
        self._unsub_pending = []
        for sub in subs.values():
            sub.fail(status, f"the gateway lost its Redis pub/sub connection ({reason}); "
                             "this request's output could not be delivered", "relay_disconnected")
        if subs:
            log.log(logging.ERROR if status == 502 else logging.WARNING,
                    "token relay: failed %d in-flight request(s): %s", len(subs), reason)

    async def _watchdog(self) -> None:
        """PING periodically; a connection silent for 3 periods is dead (e.g. the host vanished
        without closing TCP) and is closed, which makes the reader fail in-flight requests."""
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


# ---- RESP2 ---------------------------------------------------------------------------


class RespError(str):
    """An error reply (-ERR ...)."""


def _pack(parts: tuple[bytes, ...]) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def _parse(buf: bytearray, pos: int) -> tuple[object, int] | None:
    """One RESP2 value from `buf` at `pos`: (value, next position), or None if incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind = buf[pos]
    line = bytes(buf[pos + 1:end])
    nxt = end + 2
    if kind == 36:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, nxt
        if len(buf) < nxt + n + 2:
            return None
        return bytes(buf[nxt:nxt + n]), nxt + n + 2
    if kind == 42:  # * array
        n = int(line)
        items = []
        for _ in range(max(n, 0)):
            parsed = _parse(buf, nxt)
            if parsed is None:
                return None
            value, nxt = parsed
            items.append(value)
        return items, nxt
    if kind == 58:  # : integer
        return int(line), nxt
    if kind == 43:  # + simple string
        return line, nxt
    if kind == 45:  # - error
        return RespError(line.decode(errors="replace")), nxt
    raise ConnectionError(f"unexpected RESP type byte {kind!r}")


async def _read_one(reader: asyncio.StreamReader, buf: bytearray) -> object:
    while True:
        parsed = _parse(buf, 0)
        if parsed is not None:
            item, pos = parsed
            del buf[:pos]
            return item
        data = await asyncio.wait_for(reader.read(1 << 16), timeout=5.0)
        if not data:
            raise ConnectionError("Redis closed the connection during the handshake")
        buf += data
