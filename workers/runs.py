"""Per-request run state in Redis: exactly-once hand-off, fencing, and the output log.

Delivery through the work streams is at-least-once: a worker that dies (or
stalls) leaves its entries pending and another worker reclaims them
(`workers/reaper.py`). These scripts make every handler idempotent, keyed by
request id, so a second delivery never shows up twice at the client:

- **Hand-off** (prefill -> decode): the first prefill attempt to finish wins
  `HSETNX run handoff` and, in the same atomic step, puts the decode work on
  the decode stream. A later attempt of the same request (a reclaim after a
  stall, or a duplicate) finds the flag set and hands nothing on.
- **Fencing** (decode): every claim of a request's decode work bumps
  `run.attempt` and keeps the new number. Each output frame is published by
  a script that first checks the number, so a worker whose claim was taken
  over cannot publish a single stale token: its script answers FENCED and it
  stops without acking.
- **Output log**: the same script appends the frame's token ids to
  `out:<id>` and counts frames, atomically with the PUBLISH. What the log
  holds is exactly what the gateway was sent, so a decode worker that takes
  over a request whose worker died mid-stream resumes from there (prompt +
  tokens so far; frame numbering continues): no gap, no duplicate.
- **Frame log**: it also appends the encoded frame itself to `frames:<id>`
  (entry k = frame k). Token ids alone cannot rebuild a frame (text,
  logprobs, finish and stop reasons), and a gateway whose relay lost its
  connection must replay exactly what it missed (gateway/resume.py). Kept
  `outage_grace_s` + 5 s after the final frame, which is as long as a relay
  may take to come back for it.
- **Lost state**: a frame numbered beyond the request's frame count means
  Redis lost frames this attempt already published (a crash, with AOF's last
  second unwritten): the script answers STATE_LOST and applies nothing, and
  the worker fails the request explicitly rather than leave a gap.

Both keys carry the `{decode}` hash tag of the decode streams, so each script
touches a single Redis Cluster slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from skyline.core.keys import Keys

FENCED = -1  # publish() result: this worker no longer owns the request
STATE_LOST = -2  # publish() result: Redis lost frames published before this one

# KEYS: run hash, decode stream. ARGV: worker id, ttl s, maxlen, field1, value1, ...
_HANDOFF = """
if redis.call('HSETNX', KEYS[1], 'handoff', ARGV[1]) == 0 then return false end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
"""

# KEYS: run hash, output log. ARGV: worker id, ttl s.
# Leaves {attempt, done, frames, token ids...} in `out`.
_CLAIM_RUN = """
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'done', 'frames')
local out = {attempt, tonumber(state[1] or '0'), tonumber(state[2] or '0')}
for _, t in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do out[#out + 1] = tonumber(t) end
"""
_CLAIM = _CLAIM_RUN + "return out\n"

# Claim a stream entry and, when it is the request the worker expects, that request's run: the
# decode worker's claim in one round trip instead of two (on its way to the first token).
# KEYS: run hash, output log, stream. ARGV: worker id, ttl s, group, consumer, request id.
# Returns false (nothing to claim), {entry id, fields} (another request's entry: claim its
# run separately) or {entry id, fields, {attempt, done, frames, token ids...}}.
_TAKE = """
local got = redis.call('XREADGROUP', 'GROUP', ARGV[3], ARGV[4], 'COUNT', 1, 'STREAMS', KEYS[3], '>')
if not got then return false end
local entry = got[1][2][1]
local fields, id = entry[2], nil
for i = 1, #fields, 2 do
  if fields[i] == 'id' then id = fields[i + 1] break end
end
if id ~= ARGV[5] then return {entry[1], fields} end
""" + _CLAIM_RUN + "return {entry[1], fields, out}\n"

# KEYS: run hash, output log, frame log.
# ARGV: attempt, ttl s, channel, payload, final (0/1), frame number, kept-after-final s, token ids...
# Returns the PUBLISH receiver count, -1 when fenced, -2 when frames before this one are
# missing. A frame already applied (the call was retried after a broken connection) is not
# applied again.
_PUBLISH = """
local run = redis.call('HMGET', KEYS[1], 'attempt', 'frames')
if tonumber(run[1] or '0') ~= tonumber(ARGV[1]) then return -1 end
local frames = tonumber(run[2] or '0')
if frames > tonumber(ARGV[6]) then return 1 end
if frames < tonumber(ARGV[6]) then return -2 end
if #ARGV > 7 then
  if redis.call('RPUSH', KEYS[2], unpack(ARGV, 8)) == #ARGV - 7 then  -- the list is new: give it a lifetime
    redis.call('EXPIRE', KEYS[2], ARGV[2])
  end
end
if redis.call('RPUSH', KEYS[3], ARGV[4]) == 1 then redis.call('EXPIRE', KEYS[3], ARGV[2]) end
redis.call('HINCRBY', KEYS[1], 'frames', 1)
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'done', 1)
  redis.call('DEL', KEYS[2])
  redis.call('EXPIRE', KEYS[3], ARGV[7])
end
return redis.call('PUBLISH', ARGV[3], ARGV[4])
"""

KEEP_AFTER_FINAL_MARGIN_S = 5  # beyond outage_grace_s: a relay resuming at the end of its grace still finds it


def kept_after_final_s(outage_grace_s: float) -> int:
    """How long a request's frame log outlives its final frame: a relay that lost its connection
    comes back for it within its grace, or gives the request up."""
    return int(outage_grace_s + 0.999) + KEEP_AFTER_FINAL_MARGIN_S


@dataclass
class RunClaim:
    """What a decode worker learns when it claims a request's decode work."""

    attempt: int
    done: bool  # a final frame was already published: only the ack is left
    frames: int  # frames published by earlier attempts; this attempt's numbering continues from here
    output: list[int]  # token ids the client has already been sent

    @property
    def resumed(self) -> bool:
        return self.attempt > 1 and bool(self.output)


class Runs:
    def __init__(self, r: aioredis.Redis, keys: Keys, ttl_s: int, outage_grace_s: float = 10.0):
        self.r = r
        self.keys = keys
        self.ttl_s = int(ttl_s)
        self.kept_after_final_s = kept_after_final_s(outage_grace_s)
        self._handoff = r.register_script(_HANDOFF)
        self._claim = r.register_script(_CLAIM)
        self._take = r.register_script(_TAKE)
        self.publish_script = r.register_script(_PUBLISH)

    async def hand_off(self, request_id: str, stream: str, fields: dict, worker_id: str, maxlen: int) -> str | None:
        """XADD `fields` to the decode `stream` unless this request was handed off
        already; returns the new entry id, or None for a duplicate."""
        argv: list = [worker_id, self.ttl_s, maxlen]
        for k, v in fields.items():
            argv += [k, v]
        entry = await self._handoff(keys=[self.keys.run(request_id), stream], args=argv)
        if entry is None:
            return None
        return entry.decode() if isinstance(entry, bytes) else entry

    async def claim(self, request_id: str, worker_id: str) -> RunClaim:
        """Take ownership of a request's decode: fences out every earlier owner."""
        res = await self._claim(keys=[self.keys.run(request_id), self.keys.output(request_id)],
                                args=[worker_id, self.ttl_s])
        return _run_claim(res)

    async def take(self, stream: str, group: str, consumer: str, request_id: str,
                   worker_id: str) -> tuple[str, dict, RunClaim | None] | None:
        """XREADGROUP one entry of `stream` and, if it is `request_id`'s (the head the worker
        peeked at), claim its run in the same step (`claim`). None: nothing was left to claim;
        else (entry id, fields, its RunClaim or None when the entry was another request's)."""
        res = await self._take(keys=[self.keys.run(request_id), self.keys.output(request_id), stream],
                               args=[worker_id, self.ttl_s, group, consumer, request_id])
        if not res:
            return None
        flat = res[1]
        fields = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
        entry_id = res[0].decode() if isinstance(res[0], bytes) else res[0]
        return entry_id, fields, (_run_claim(res[2]) if len(res) > 2 else None)

    def publish_args(self, request_id: str, attempt: int, channel: str, payload: bytes, final: bool,
                     token_ids: list[int], frame: int) -> tuple[list[str], list]:
        """KEYS and ARGV of one fenced publish (run in a pipeline by the BatchPublisher).
        `frame`: the frame's number in the request's stream (its `seq`)."""
        return ([self.keys.run(request_id), self.keys.output(request_id), self.keys.frames(request_id)],
                [attempt, self.ttl_s, channel, payload, 1 if final else 0, frame, self.kept_after_final_s,
                 *token_ids])


def _run_claim(res: list) -> RunClaim:
    return RunClaim(attempt=int(res[0]), done=bool(res[1]), frames=int(res[2]), output=[int(t) for t in res[3:]])
