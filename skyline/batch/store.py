"""Batch files, batches and their per-line results in Redis (keys: skyline/core/keys.py, "batch jobs").

Why Redis and not a directory: the gateway that takes an upload, the runner
that executes the batch and the gateway that serves its output may be on
different hosts, and Redis is the one thing they all reach. Uploads are
bounded (`batch.max_file_bytes`, `batch.max_lines`) and expire
(`batch.file_ttl_s`), so the memory a batch can take is bounded too.

Ownership: with API keys on, a file and a batch carry `owner`, the digest of
the key that created it (gateway/tenants.py decides who may see what; this
module only keeps it). A batch's output and error files get the batch's
owner. Lists come from sorted sets: one of everything (operators, keyless
gateways) and one per owner, so a tenant's list never walks other tenants'
entries.

Every change of a batch's status is a Lua transition that names the states
it may leave, so a cancel racing a runner (or two runners racing after a
retry) settles on one outcome. A line's result is recorded at most once
(HSETNX), in the same script that counts it as completed or failed.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from skyline.batch import jsonl
from skyline.batch.objects import COMPLETION_WINDOWS, batch_object, file_object, usage_object
from skyline.core.keys import Keys

# KEYS: batch hash. ARGV: allowed current statuses (space-separated), new status, field, value, ...
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {0, ''} end
for s in string.gmatch(ARGV[1], '%S+') do
  if s == cur then
    redis.call('HSET', KEYS[1], 'status', ARGV[2])
    for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    return {1, cur}
  end
end
return {0, cur}
"""

# KEYS: results hash, batch hash. ARGV: line, output line (JSON), counter to bump ("completed"/"failed").
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex[:24]


class BatchStore:
    def __init__(self, r: aioredis.Redis, keys: Keys, file_ttl_s: int):
        self.r = r
        self.keys = keys
        self.ttl_s = file_ttl_s
        self._transition = r.register_script(_TRANSITION)
        self._record = r.register_script(_RECORD)

    # ---- files --------------------------------------------------------------------------

    async def put_file(self, content: bytes, filename: str, purpose: str, file_id: str | None = None,
                       owner: str = "") -> dict[str, Any]:
        """Store a file; `owner` ("" = none: a gateway without keys) is kept with it and lists it."""
        fid = file_id or new_file_id()
        now = int(time.time())
        meta = {"id": fid, "filename": filename, "purpose": purpose, "bytes": len(content), "created_at": now}
        if self.ttl_s:
            meta["expires_at"] = now + self.ttl_s
        if owner:
            meta["owner"] = owner
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.keys.file(fid))  # a re-written output file replaces the old one whole
        pipe.hset(self.keys.file(fid), mapping=meta)
        pipe.set(self.keys.file_content(fid), content)
        if self.ttl_s:
            pipe.expire(self.keys.file(fid), self.ttl_s)
            pipe.expire(self.keys.file_content(fid), self.ttl_s)
        await pipe.execute()
        # The lists after the file itself, outside its transaction: they have no hash tag (another
        # Cluster slot), and a listed id whose file is missing is dropped by the next listing anyway.
        pipe = self.r.pipeline(transaction=False)
        for zset in (self.keys.files, *([self.keys.files_of(owner)] if owner else [])):
            pipe.zadd(zset, {fid: now})
            if self.ttl_s:
                pipe.expire(zset, self.ttl_s)  # every member's file is gone by then
        await pipe.execute()
        return file_object(meta)

    async def file_fields(self, file_id: str) -> dict[str, str] | None:
        """The file's hash as text, `owner` included (None: no such file, or expired)."""
        raw = await self.r.hgetall(self.keys.file(file_id))
        return {k.decode(): v.decode() for k, v in raw.items()} if raw else None

    async def file(self, file_id: str) -> dict[str, Any] | None:
        raw = await self.r.hgetall(self.keys.file(file_id))
        return file_object(raw) if raw else None

    async def list_files(self, after: str | None, limit: int, owner: str = "", purpose: str | None = None,
                         newest_first: bool = True) -> tuple[list[dict[str, Any]], bool]:
        """Files as OpenAI lists them (`after` an id, at most `limit`, optionally of one `purpose`):
        `owner`'s, or every file when `owner` is ""."""
        return await self._page(self.keys.files_of(owner) if owner else self.keys.files, after, limit, self.file,
                                (lambda f: f["purpose"] == purpose) if purpose else None, newest_first)

    async def file_content(self, file_id: str) -> bytes | None:
        return await self.r.get(self.keys.file_content(file_id))

    # ---- batches ------------------------------------------------------------------------

    async def create_batch(self, fields: dict[str, Any]) -> None:
        """A new batch hash; an `owner` field (the creating key's digest) also lists it for that owner."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(fields["id"]), mapping={k: v for k, v in fields.items() if v is not None})
        for zset in (self.keys.batches, *([self.keys.batches_of(fields["owner"])] if fields.get("owner") else [])):
            pipe.zadd(zset, {fields["id"]: fields["created_at"]})
            if self.ttl_s:
                # A batch ends within its window and is kept `ttl_s` after: the list outlives its members.
                pipe.expire(zset, max(COMPLETION_WINDOWS.values()) + self.ttl_s)
        await pipe.execute()

    async def batch_fields(self, batch_id: str) -> dict[str, str] | None:
        raw = await self.r.hgetall(self.keys.batch(batch_id))
        if not raw:
            return None
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def batch(self, batch_id: str) -> dict[str, Any] | None:
        fields = await self.batch_fields(batch_id)
        return batch_object(fields) if fields else None

    async def status(self, batch_id: str) -> str | None:
        raw = await self.r.hget(self.keys.batch(batch_id), "status")
        return raw.decode() if raw else None

    async def list_batches(self, after: str | None, limit: int, owner: str = "") -> tuple[list[dict[str, Any]], bool]:
        """Newest first, OpenAI-style paging: the batches created before `after`, at most `limit`;
        `owner`'s, or every batch when `owner` is ""."""
        return await self._page(self.keys.batches_of(owner) if owner else self.keys.batches, after, limit,
                                self.batch)

    async def _page(self, zset: str, after: str | None, limit: int, load: Any, keep: Any = None,
                    newest_first: bool = True) -> tuple[list[dict[str, Any]], bool]:
        """One page of the objects listed in `zset` (id -> created_at), after the id `after`:
        at most `limit` objects that `load(id)` finds and `keep(obj)` (when given) accepts, and
        whether more follow. Ids whose object expired are dropped from `zset` on the way."""
        rank_of, ids_in = ((self.r.zrevrank, self.r.zrevrange) if newest_first else (self.r.zrank, self.r.zrange))
        start = 0
        if after:
            rank = await rank_of(zset, after)
            if rank is None:
                return [], False
            start = rank + 1
        out: list[dict[str, Any]] = []
        gone: list[str] = []
        while len(out) <= limit:  # one more than asked: is there more?
            chunk = await ids_in(zset, start, start + limit)
            if not chunk:
                break
            start += len(chunk)
            for raw_id in chunk:
                obj = await load(raw_id.decode())
                if obj is None:
                    gone.append(raw_id.decode())  # its hash expired
                elif keep is None or keep(obj):
                    out.append(obj)
                    if len(out) > limit:
                        break
        if gone:
            await self.r.zrem(zset, *gone)
        return out[:limit], len(out) > limit

    async def transition(self, batch_id: str, allowed_from: tuple[str, ...], to: str,
                         **fields: Any) -> tuple[bool, str]:
        """Move the batch to `to` (setting `fields`) if its status is one of `allowed_from`.
        Returns (moved, the status it had)."""
        args: list[Any] = [" ".join(allowed_from), to]
        for k, v in fields.items():
            args += [k, v if isinstance(v, (str, int)) else json.dumps(v)]
        moved, was = await self._transition(keys=[self.keys.batch(batch_id)], args=args)
        return bool(moved), was.decode() if isinstance(was, bytes) else was

    # ---- per-line results ---------------------------------------------------------------

    async def record(self, batch_id: str, line: int, out_line: dict[str, Any]) -> bool:
        """Keep `out_line` as line `line`'s result unless it has one; True if this call recorded it."""
        counter = "completed" if jsonl.is_success(out_line) else "failed"
        done = await self._record(keys=[self.keys.batch_results(batch_id), self.keys.batch(batch_id)],
                                  args=[line, jsonl.dumps(out_line), counter])
        return bool(done)

    async def result(self, batch_id: str, line: int) -> dict[str, Any] | None:
        raw = await self.r.hget(self.keys.batch_results(batch_id), line)
        return json.loads(raw) if raw else None

    async def done_lines(self, batch_id: str) -> set[int]:
        return {int(k) for k in await self.r.hkeys(self.keys.batch_results(batch_id))}

    async def claim(self, batch_id: str, line: int, ttl_s: int, owner: str) -> bool:
        return bool(await self.r.set(self.keys.batch_claim(batch_id, line), owner, nx=True, ex=ttl_s))

    async def release(self, batch_id: str, line: int) -> None:
        await self.r.delete(self.keys.batch_claim(batch_id, line))

    # ---- the end ------------------------------------------------------------------------

    async def finalize(self, batch_id: str, custom_ids: dict[int, str | None], status: str,
                       fill_code: str, fill_message: str) -> dict[str, Any] | None:
        """Write the output and error files and end the batch in `status`.

        Lines without a result get an error line (`fill_code`: the batch was
        cancelled or expired before they ran), so the two files together hold
        exactly one line per request line, in input order. Idempotent: the
        files have ids derived from the batch id, so a runner that dies here
        and is retried writes the same files again.
        """
        done = await self.done_lines(batch_id)
        missing = [(line, cid) for line, cid in custom_ids.items() if line not in done]
        for start in range(0, len(missing), 1000):
            pipe = self.r.pipeline(transaction=False)
            for line, cid in missing[start:start + 1000]:
                pipe.hsetnx(self.keys.batch_results(batch_id), line,
                            jsonl.dumps(jsonl.error_line(cid, fill_code, fill_message)))
            await pipe.execute()
        results: dict[int, str] = {}
        async for k, v in self.r.hscan_iter(self.keys.batch_results(batch_id), count=1000):
            results[int(k)] = v.decode()
        output, errors = [], []
        prompt = completion = 0
        for line in sorted(results):
            parsed = json.loads(results[line])
            (output if jsonl.is_success(parsed) else errors).append(results[line])
            p, c = jsonl.usage_of(parsed)
            prompt, completion = prompt + p, completion + c
        stem = batch_id.removeprefix("batch_")
        owner = (await self.batch_fields(batch_id) or {}).get("owner", "")  # the batch's files are its owner's
        files: dict[str, Any] = {}
        if output:
            f = await self.put_file(("\n".join(output) + "\n").encode(), f"{batch_id}_output.jsonl",
                                    "batch_output", f"file-{stem}-output", owner)
            files["output_file_id"] = f["id"]
        if errors:
            f = await self.put_file(("\n".join(errors) + "\n").encode(), f"{batch_id}_error.jsonl",
                                    "batch_output", f"file-{stem}-errors", owner)
            files["error_file_id"] = f["id"]
        now = int(time.time())
        # The counters are recounted from the results: the filled lines were not counted as they went in.
        moved, _was = await self.transition(batch_id, ("validating", "in_progress", "finalizing", "cancelling"), status,
                                            **files, **{f"{status}_at": now}, completed=len(output),
                                            failed=len(errors), usage=usage_object(prompt, completion))
        if moved and self.ttl_s:
            await self.expire(batch_id)
        return await self.batch(batch_id)

    async def fail(self, batch_id: str, errors: list[jsonl.LineError]) -> bool:
        """End a batch that cannot start (or cannot go on) in `failed`, saying why."""
        moved, _ = await self.transition(batch_id, ("validating", "in_progress", "finalizing"), "failed",
                                         failed_at=int(time.time()), errors=[e.as_batch_error() for e in errors])
        if moved and self.ttl_s:
            await self.expire(batch_id)
        return moved

    async def expire(self, batch_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.expire(self.keys.batch(batch_id), self.ttl_s)
        pipe.expire(self.keys.batch_results(batch_id), self.ttl_s)
        await pipe.execute()
