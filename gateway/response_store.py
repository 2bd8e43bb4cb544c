"""The Responses API's store in Redis: stored responses, their conversations, background streams.

vLLM keeps its store in one process's memory (`OpenAIServingResponses.response_store`,
`msg_store`, `event_store`); a fleet has several gateways and restarts them, so here the store
is Redis (keys: skyline/core/keys.py, "the Responses API's store"), and what vLLM keeps in memory
only lives there while one request runs (gateway/responses_api.py).

A record holds what `GET /v1/responses/{id}` answers (the response object, JSON), what
`previous_response_id` continues (the conversation vLLM rendered for it: its messages), the
input items (`GET .../input_items`), its owner and its status. Every status change is a Lua
transition that names the statuses it may leave, so a cancel racing the gateway that finishes
the response settles on one outcome. A background response carries a lease the gateway running
it renews; once it lapsed (that gateway died), the next reader marks the response failed.

Each tenant's stored bytes are bounded (`gateway.response_store_max_bytes`, or its key's own
`response_store_bytes`): an accounting per
owner (ids, their sizes and expiry) is updated by one script before a record is written, which
refuses what would take the tenant past its bound; a record that replaces one no larger is always
taken, so a background response can always be closed.

Ownership (gateway/tenants.py decides who sees what) is kept here, not checked: the caller
compares `owner`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from skyline.core.keys import Keys

ACTIVE = ("queued", "in_progress")  # a background response still running
LEASE_S = 10.0  # a background response whose gateway has not renewed its lease for this long is failed

# KEYS: the owner's expiry ZSET, its bytes HASH. ARGV: id, bytes, expires (ms), now (ms), limit
# (0 = none), mode ("new": refuse an id already there; "replace"; "usage": only count), TTL (ms).
# Returns {1 stored | 0 over the limit | -1 the id is there already, the owner's total bytes}.
_ACCOUNT = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[4], 'LIMIT', 0, 256)
local total = tonumber(redis.call('HGET', KEYS[2], 'total') or '0')
for _, m in ipairs(expired) do
  total = total - tonumber(redis.call('HGET', KEYS[2], m) or '0')
  redis.call('HDEL', KEYS[2], m)
  redis.call('ZREM', KEYS[1], m)
end
if total < 0 then total = 0 end
if #expired > 0 then redis.call('HSET', KEYS[2], 'total', total) end
if ARGV[6] == 'usage' then return {1, total} end
local old = redis.call('HGET', KEYS[2], ARGV[1])
if ARGV[6] == 'new' and old then return {-1, total} end
old = tonumber(old or '0')
local size = tonumber(ARGV[2])
local limit = tonumber(ARGV[5])
if limit > 0 and size > old and total - old + size > limit then return {0, total} end
total = total - old + size
redis.call('HSET', KEYS[2], ARGV[1], size, 'total', total)
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[7])
return {1, total}
"""

# KEYS: the owner's expiry ZSET, its bytes HASH. ARGV: id. What a deleted response held, released.
_RELEASE = """
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
local total = tonumber(redis.call('HGET', KEYS[2], 'total') or '0') - size
if total < 0 then total = 0 end
redis.call('HSET', KEYS[2], 'total', total)
return total
"""

# KEYS: the response HASH. ARGV: TTL (s), field, value, ... A new record: refused (0) if the id is taken.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS: the response HASH. ARGV: statuses it may leave (space-separated), new status, field, value, ...
# Returns {1, previous status} when done, {0, current status or ''} when not.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {0, ''} end
for s in string.gmatch(ARGV[1], '%S+') do
  if s == cur then
    redis.call('HSET', KEYS[1], 'status', ARGV[2])
    redis.call('HINCRBY', KEYS[1], 'version', 1)
    for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    return {1, cur}
  end
end
return {0, cur}
"""

# KEYS: the response HASH. ARGV: the lease's end (ms). Its status, or nil once deleted or expired.
_RENEW = """
local cur = redis.call('HGET', KEYS[1], 'status')
if cur then redis.call('HSET', KEYS[1], 'lease_ms', ARGV[1]) end
return cur
"""


class StoreFull(Exception):
    """The tenant's stored responses would pass its bound."""

    def __init__(self, used: int, size: int, limit: int):
        super().__init__(f"{used} bytes stored, {size} more asked, bound {limit}")
        self.used, self.size, self.limit = used, size, limit


class IdTaken(Exception):
    """A response with this id is stored already (a client-chosen `request_id` used twice)."""


@dataclass(frozen=True)
class StoredResponse:
    """One record, as read back."""

    id: str
    owner: str
    status: str
    response: dict[str, Any]  # the response object
    messages: list[Any] | None  # the conversation vLLM rendered (None: not kept, e.g. failed early)
    input_items: list[dict[str, Any]]
    created_at: int
    lease_ms: int = 0  # a background response: when its running gateway's lease ends
    stream: bool = False  # a background stream: its events are kept

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    def lease_lapsed(self, now_ms: int) -> bool:
        """Running in the background on a gateway that stopped renewing its lease."""
        return self.active and 0 < self.lease_ms < now_ms


def encode(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class ResponseStore:
    """The store over one Redis client. `ttl_s`: how long a record lives; `max_bytes`: each
    owner's bound (0 = none)."""

    def __init__(self, r: aioredis.Redis, keys: Keys, ttl_s: int, max_bytes: int):
        self.r = r
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._account = r.register_script(_ACCOUNT)
        self._release = r.register_script(_RELEASE)
        self._create = r.register_script(_CREATE)
        self._transition = r.register_script(_TRANSITION)
        self._renew = r.register_script(_RENEW)

    # ---- writing ------------------------------------------------------------------------

    async def usage(self, owner: str) -> int:
        """The bytes `owner`'s stored responses take now (expired ones dropped first)."""
        return int((await self._run_account(owner, "", 0, "usage"))[1])

    async def check_room(self, owner: str, limit: int | None = None) -> None:
        """StoreFull when `owner` has no room left at all under `limit` (None: the store's bound):
        refused before a response is computed."""
        limit = self.max_bytes if limit is None else limit
        if limit and (used := await self.usage(owner)) >= limit:
            raise StoreFull(used, 0, limit)

    async def create(self, rid: str, owner: str, status: str, response: dict[str, Any], messages: list[Any] | None,
                     input_items: list[dict[str, Any]], *, background: bool = False, stream: bool = False,
                     limit: int | None = None) -> None:
        """A new record. StoreFull past the owner's bound (`limit`; None: the store's), IdTaken when
        the id is stored already."""
        fields = {"owner": owner, "status": status, "version": 0, "response": encode(response),
                  "messages": "" if messages is None else encode(messages), "input": encode(input_items),
                  "created_at": int(response.get("created_at") or time.time())}
        if background:
            fields["lease_ms"] = _now_ms() + int(LEASE_S * 1000)
        if stream:
            fields["stream"] = 1
        size = _size(fields)
        fields["bytes"] = size
        limit = self.max_bytes if limit is None else limit
        ok, used = await self._run_account(owner, rid, size, "new", limit)
        if ok == -1:
            raise IdTaken(rid)
        if ok == 0:
            raise StoreFull(used, size, limit)
        args: list[Any] = [self.ttl_s]
        for k, v in fields.items():
            args += [k, v]
        if not await self._create(keys=[self.keys.response(rid)], args=args):
            await self._release(keys=self._owner_keys(owner), args=[rid])  # another tenant's id: ours was new
            raise IdTaken(rid)

    async def finish(self, rec: StoredResponse, status: str, response: dict[str, Any],
                     messages: list[Any] | None = None, *, leave: tuple[str, ...] = ACTIVE,
                     limit: int | None = None) -> bool:
        """Move a record from one of `leave` to `status` with its final `response` (and conversation).
        False when it had left those already (cancelled, deleted, failed by a reader). A response
        past its owner's bound is stored as failed instead (its error says so); that is no larger
        than the record it replaces, so it is always taken."""
        fields: dict[str, Any] = {"response": encode(response), "lease_ms": 0}
        if messages is not None:
            fields["messages"] = encode(messages)
        size = _size({**_rest(rec), **fields})
        limit = self.max_bytes if limit is None else limit
        ok, used = await self._run_account(rec.owner, rec.id, size, "replace", limit)
        if ok != 1:
            status = "failed"
            response = with_error({**response, "output": [], "usage": None}, "failed", "server_error",
                                  f"the response was computed but not stored: its owner's stored responses take "
                                  f"{used} bytes of the {limit} it may keep ([gateway] response_store_max_bytes)")
            fields = {"response": encode(response), "lease_ms": 0}
        done = await self._move(rec.id, leave, status, fields)
        if not done:  # left alone: count what the record still holds
            await self._run_account(rec.owner, rec.id, _size(_rest(rec)), "replace")
        return done

    async def mark(self, rec: StoredResponse, status: str, response: dict[str, Any],
                   leave: tuple[str, ...] = ACTIVE) -> bool:
        """A status change that keeps the record's size about the same (in_progress, cancelled, failed)."""
        return await self._move(rec.id, leave, status, {"response": encode(response)})

    async def renew(self, rid: str) -> str | None:
        """Renew a background response's lease; its status now (None: deleted or expired)."""
        status = await self._renew(keys=[self.keys.response(rid)], args=[_now_ms() + int(LEASE_S * 1000)])
        return None if status is None else status.decode()

    async def append_events(self, rid: str, events: list[str]) -> None:
        """Events of a background stream, in order (JSON text each)."""
        if events:
            key = self.keys.response_events(rid)
            pipe = self.r.pipeline(transaction=True)
            pipe.rpush(key, *events)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def delete(self, rec: StoredResponse) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.response(rec.id), self.keys.response_events(rec.id))
        await pipe.execute()
        await self._release(keys=self._owner_keys(rec.owner), args=[rec.id])

    # ---- reading ------------------------------------------------------------------------

    async def get(self, rid: str) -> StoredResponse | None:
        raw = await self.r.hgetall(self.keys.response(rid))
        if not raw or b"status" not in raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return StoredResponse(
            id=rid, owner=f.get("owner", ""), status=f["status"], response=json.loads(f["response"]),
            messages=json.loads(f["messages"]) if f.get("messages") else None,
            input_items=json.loads(f.get("input") or "[]"), created_at=int(f.get("created_at") or 0),
            lease_ms=int(f.get("lease_ms") or 0), stream=f.get("stream") == "1")

    async def events_after(self, rid: str, start: int) -> tuple[list[str], str | None]:
        """A background stream's events from index `start` on, and the response's status now."""
        pipe = self.r.pipeline(transaction=False)
        pipe.lrange(self.keys.response_events(rid), start, -1)
        pipe.hget(self.keys.response(rid), "status")
        events, status = await pipe.execute()
        return [e.decode() for e in events], None if status is None else status.decode()

    # ---- helpers ------------------------------------------------------------------------

    def _owner_keys(self, owner: str) -> list[str]:
        return [self.keys.responses_of(owner), self.keys.response_bytes_of(owner)]

    async def _run_account(self, owner: str, rid: str, size: int, mode: str, limit: int = 0) -> tuple[int, int]:
        """The accounting script (`limit` 0: none, e.g. a record kept as it is)."""
        now = _now_ms()
        ok, total = await self._account(keys=self._owner_keys(owner), args=[
            rid, size, now + self.ttl_s * 1000, now, limit, mode, self.ttl_s * 1000])
        return int(ok), int(total)

    async def _move(self, rid: str, leave: tuple[str, ...], status: str, fields: dict[str, Any]) -> bool:
        args: list[Any] = [" ".join(leave), status]
        for k, v in fields.items():
            args += [k, v]
        done, _cur = await self._transition(keys=[self.keys.response(rid)], args=args)
        return bool(done)


def with_error(response: dict[str, Any], status: str, code: str, message: str) -> dict[str, Any]:
    """`response` ended with `status` for the reason given (the API's `error` object)."""
    return {**response, "status": status, "error": {"code": code, "message": message}}


def _rest(rec: StoredResponse) -> dict[str, Any]:
    """The fields of `rec` that count towards its size."""
    return {"owner": rec.owner, "response": encode(rec.response),
            "messages": "" if rec.messages is None else encode(rec.messages), "input": encode(rec.input_items)}


def _size(fields: dict[str, Any]) -> int:
    return sum(len(str(k)) + len(str(v).encode()) for k, v in fields.items())


def _now_ms() -> int:
    return int(time.time() * 1000)
