"""Every Redis key and channel Skyline uses, built in one place.

Read this file as the map of the keyspace; `redis-cli` output should read
like it. Each entry gives the Redis type, who writes it, who reads it and its
lifetime. `prefix` (default "skyline") lets several fleets share one Redis.

Redis Cluster: a prefill worker waits on all tier streams of one stage with a
single multi-key XREAD, so all streams of a stage carry the same hash tag
(`{prefill}` / `{decode}`) and live on one shard. Pub/sub channels are not
slotted. Per-request and per-worker keys are single-key operations and spread
freely across shards.

Several models through one fleet: each model's work has its own queues (its
prefill and decode tier streams, retry and affinity lanes, backlog), named
by its keyspace (`Keys.model`, `keyspace_of`). The fleet's default model keeps
the plain keys above (`skyline:{prefill}:interactive`), so a one-model fleet's
keyspace is what it always was; another model's stage streams carry its name
in the hash tag (`skyline:{prefill:llama-8b}:interactive`: one model's streams
of a stage on one shard, different models spread) and its backlog its name
(`skyline:backlog:llama-8b`). Everything keyed by a request or a worker is
shared: ids are unique fleet-wide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFILL_GROUP = "prefill"  # consumer group on every prefill tier stream
DECODE_GROUP = "decode"  # consumer group on every decode tier stream
STAGES = ("prefill", "decode")


def keyspace_of(served_model: str, default_model: str) -> str:
    """The keyspace of a model's queues: "" (the plain keys) for the fleet's default model (and for any
    model when no default is named), else its served name with the characters a hash tag or a key
    pattern would misread (`{`, `}`, `*`, `?`, `[`, `]`, blanks) as `_`."""
    if not default_model or served_model == default_model:
        return ""
    return re.sub(r"[{}*?\[\]\s]", "_", served_model)


@dataclass(frozen=True)
class Keys:
    prefix: str = "skyline"
    # The keyspace of one model's queues ("" = the default model's: the plain keys). Only the
    # stage-scoped keys below depend on it (tier streams, retry and affinity lanes, the lanes
    # set, the backlog); `for_model` gives the same prefix's keys of another model.
    model: str = ""

    def for_model(self, keyspace: str) -> Keys:
        return self if keyspace == self.model else Keys(self.prefix, keyspace)

    def _stage(self, stage: str) -> str:
        """`skyline:{prefill}` (default model) or `skyline:{prefill:<model>}`: the hash-tagged stem of a stage."""
        return f"{self.prefix}:{{{stage}:{self.model}}}" if self.model else f"{self.prefix}:{{{stage}}}"

    def stream(self, stage: str, tier: str) -> str:
        """STREAM `skyline:{prefill}:interactive` — work waiting for a stage, one per SLO tier.

        Written by the gateway (prefill, or decode for colocated routing) and
        by prefill workers (decode); read by the stage's consumer group.
        Entries: readable summary fields + `msg` (msgpack). Trimmed by MAXLEN.
        """
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        return f"{self._stage(stage)}:{tier}"

    def retry_stream(self, stage: str, tier: str) -> str:
        """STREAM `skyline:{prefill}:interactive:retry` — work of one tier returned to the queue.

        A worker that preempts a request, or hands it back while draining, re-adds
        it here with its original arrival and deadline. Stream entries cannot be
        inserted ahead of others, and on the tier's own stream it would wait behind
        every request that arrived after it; workers compare this lane's head with
        the tier stream's and take the earlier deadline first. Same consumer group.
        """
        return f"{self.stream(stage, tier)}:retry"

    def affinity_lane(self, stage: str, tier: str, worker_id: str) -> str:
        """STREAM `skyline:{decode}:interactive:@<worker>` — work placed for one worker's prefix cache.

        Written by the gateway when the worker's engine holds the longest leading run of the
        prompt's blocks (scheduler/prefix.py); read by every worker of the stage with the stage's
        group: the worker it names claims it at once, any other once its entry's `until_ms` has
        passed or the worker is gone. Same hash tag as the stage's tier streams. Listed in
        `affinity_lanes`; deleted, once empty, after its worker departed.
        """
        return f"{self.stream(stage, tier)}:@{worker_id}"

    def affinity_lanes(self, stage: str) -> str:
        """SET `skyline:{decode}:lanes` — worker ids that have affinity lanes in this stage.

        SADD'ed by the gateway with each placement; read by the stage's workers (which streams to
        watch); SREM'ed by a worker's departed-consumer sweep once the lanes are empty."""
        return f"{self._stage(stage)}:lanes"

    def kv_cache(self, worker_id: str) -> str:
        """ZSET `skyline:kvcache:<worker>` — the blocks its engine's prefix cache holds.

        Member: a block's hash in Skyline's chain (16 hex digits, scheduler/prefix.py); score:
        when it was stored (Unix ms). Written by the worker from its engine's KV cache events
        (stored, evicted, cleared); read by the gateway to place requests. At most
        `worker.cache_view_max_blocks` members (the oldest go first); expires with the worker's
        heartbeat, so a dead worker's view is gone within its TTL.
        """
        return f"{self.prefix}:kvcache:{worker_id}"

    @property
    def adapters(self) -> str:
        """HASH `skyline:adapters` — the fleet's LoRA adapters: field = the adapter's name (what clients send
        as `model`), value = JSON {name, path, lora_id, base_model, loaded_ms, static}.

        Written by the gateway's POST /v1/load_lora_adapter and /v1/unload_lora_adapter and by workers
        started with --lora-modules (skyline/core/adapters.py); read by every gateway (what it serves,
        `/v1/models`) and every worker (what its engine may keep: an adapter gone from here is removed
        from the engine at its next heartbeat). No TTL: it lives until unloaded.
        """
        return f"{self.prefix}:adapters"

    @property
    def adapter_ids(self) -> str:
        """STRING `skyline:adapter_ids` — INCR counter of LoRA ids: each load of an adapter gets a new
        fleet-wide id (vLLM's lora_int_id), so no engine serves a reloaded adapter with old weights."""
        return f"{self.prefix}:adapter_ids"

    @property
    def adapter_checks(self) -> str:
        """LIST `skyline:adapter_checks` (`skyline:adapter_checks:<model>` for another model) — a gateway's
        load route asks a worker of the base model to read an adapter's path where the engines run: JSON
        {path, reply, until_ms}, RPUSH'ed by the gateway, BLPOP'ed by one worker that runs LoRA
        (skyline/core/adapters.py `ask_check`). Expires 30 s after the last check: nobody read it."""
        return f"{self.prefix}:adapter_checks" + (f":{self.model}" if self.model else "")

    def adapter_check_reply(self, nonce: str) -> str:
        """LIST `skyline:adapter_check:<nonce>` — the answer to one check: JSON {worker, problem, missing},
        RPUSH'ed by the worker, BLPOP'ed by the gateway that asked. TTL 30 s."""
        return f"{self.prefix}:adapter_check:{nonce}"

    def tokens(self, request_id: str) -> str:
        """CHANNEL `skyline:tokens:<request id>` — output frames of one request.

        The gateway subscribes before enqueueing; the decode worker publishes
        msgpack TokenDelta/Finished/Failed frames. No storage: lives as long
        as the subscription.
        """
        return f"{self.prefix}:tokens:{request_id}"

    @property
    def cancel(self) -> str:
        """CHANNEL `skyline:cancel` — Cancel messages broadcast by the gateway to all workers."""
        return f"{self.prefix}:cancel"

    def cancelled(self, request_id: str) -> str:
        """STRING `skyline:cancelled:<request id>` — tombstone of a cancelled request.

        Set by the gateway with a TTL so that a worker which claims the request
        later (it was still queued when the client left) skips it.
        """
        return f"{self.prefix}:cancelled:{request_id}"

    @property
    def workers(self) -> str:
        """ZSET `skyline:workers` — worker id -> last heartbeat (Unix seconds).

        Written by every worker's heartbeat; read by the gateway (is a role
        alive?) and `skyline status`. Stale members are pruned by readers.
        """
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        """HASH `skyline:worker:<id>` — role, engine, model (served name, keyspace, what the gateway
        renders it with), load, address. TTL = 3 heartbeats."""
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def backlog(self) -> str:
        """HASH `skyline:backlog` — `<stage>:<tier>` -> prompt tokens admitted and not yet prefilled.

        HINCRBY'd by whoever enqueues work that needs a prefill, decremented by
        the worker when it acks the entry (queued + in progress, so a burst
        sees the work already handed to engines); read by admission control.
        An estimate (a crash between XACK and HINCRBY skews it), clamped at 0.
        Another model's: `skyline:backlog:<model>`.
        """
        return f"{self.prefix}:backlog:{self.model}" if self.model else f"{self.prefix}:backlog"

    @staticmethod
    def backlog_field(stage: str, tier: str) -> str:
        return f"{stage}:{tier}"

    @property
    def dead(self) -> str:
        """STREAM `skyline:dead` — requests that could not be processed (poison / failed), for humans."""
        return f"{self.prefix}:dead"

    def run(self, request_id: str) -> str:
        """HASH `skyline:{decode}:run:<id>` — delivery state of one request (workers/runs.py).

        `handoff` (prefill worker that handed it to decode: set once, so a
        reclaimed prefill cannot hand it off twice), `attempt` (bumped by every
        decode claim; output frames of an older attempt are fenced out),
        `owner`, `frames` (published so far), `done`. Written by prefill and
        decode workers through Lua scripts; TTL `redis.run_ttl_s`.
        """
        return f"{self.prefix}:{{decode}}:run:{request_id}"

    def output(self, request_id: str) -> str:
        """LIST `skyline:{decode}:out:<id>` — token ids already sent to the client.

        Appended atomically with each frame's PUBLISH; read by a decode worker
        that takes over a request mid-stream (migration). Deleted by the
        final frame; TTL `redis.run_ttl_s`.
        """
        return f"{self.prefix}:{{decode}}:out:{request_id}"

    def frames(self, request_id: str) -> str:
        """LIST `skyline:{decode}:frames:<id>` — every output frame of one request, as published.

        Entry k is frame k (its `seq`), RPUSHed by the publish script atomically with its
        PUBLISH; a Failed frame a worker publishes outside the script (`seq` 2**30) is
        appended last. Read by the gateway's relay after it lost its connection: it catches
        each request up from the frame after the last one it delivered (gateway/resume.py).
        TTL `redis.run_ttl_s`; `redis.outage_grace_s` + 5 s once the request has ended.
        """
        return f"{self.prefix}:{{decode}}:frames:{request_id}"

    @property
    def epoch(self) -> str:
        """STRING `skyline:{decode}:epoch` — a random token, set once (SET NX) by the first relay
        that finds none. A relay that finds another token (or none) after reconnecting knows
        Redis lost its data meanwhile (a restart without persistence, a flush): the requests it
        held have no state left. Same hash tag as the run state it vouches for. No TTL.
        """
        return f"{self.prefix}:{{decode}}:epoch"

    def timeline(self, request_id: str) -> str:
        """LIST `skyline:timeline:<id>` — what happened to one request, one JSON event per entry.

        `{"event", "t_ms", "who", "fields"}` (skyline/core/timeline.py), RPUSHed by
        whichever process saw the event (gateway, prefill or decode worker);
        read by `GET /v1/requests/{id}/timeline` and `skyline trace`. The
        newest `observability.timeline_max_events` are kept; TTL
        `observability.timeline_ttl_s`, renewed by every event.
        """
        return f"{self.prefix}:timeline:{request_id}"

    def requester(self, request_id: str) -> str:
        """STRING `skyline:requester:<id>` — the owner digest of the API key that sent the request.

        HMAC-SHA256 of the key under the owner secret (`key_digest`,
        gateway/tenants.py), never the key. Written by the gateway (only when
        API keys are on), read by the timeline route so a client sees only
        its own requests. Same TTL as the timeline.
        """
        return f"{self.prefix}:requester:{request_id}"

    def slo_minute(self, minute: int) -> str:
        """HASH `skyline:slo:<unix minute>` — requests finished in that minute, by tier and verdict.

        Fields `<tier>:done` (answered), `<tier>:met` (TTFT and TPOT targets
        met), `<tier>:ttft_met`, `<tier>:failed` (error or refused answer).
        HINCRBY'd by every gateway; read by `skyline status` and /dashboard.
        TTL `observability.slo_window_minutes`.
        """
        return f"{self.prefix}:slo:{minute}"

    @property
    def recent(self) -> str:
        """LIST `skyline:recent` — the latest finished requests, newest first, one JSON object each.

        `{"id", "tier", "t_ms", "status", "ttft_ms", "tpot_ms", "e2e_ms", "slo_met", ...}`
        LPUSHed by every gateway, capped at `observability.recent_requests`;
        read by /dashboard (percentiles, slowest requests).
        """
        return f"{self.prefix}:recent"

    # ---- batch jobs (skyline/batch/). Each file and each batch carries its own id as a
    # hash tag, so the scripts that touch a batch's hash, results and claims run on one slot.

    def file(self, file_id: str) -> str:
        """HASH `skyline:file:{<id>}` — an uploaded or produced file's metadata (OpenAI file object).

        `id`, `filename`, `purpose` (batch, batch_output), `bytes`,
        `created_at`, `expires_at`, `owner` (the creating key's digest, when
        API keys are on; a batch's output and error files get the batch's).
        Written by the gateway (upload) and the batch runner (output and
        error files); read by `GET /v1/files/{id}`. TTL `batch.file_ttl_s`.
        """
        return f"{self.prefix}:file:{{{file_id}}}"

    def file_content(self, file_id: str) -> str:
        """STRING `skyline:file:{<id>}:content` — the file's bytes (JSONL), at most `batch.max_file_bytes`.

        Same writers and lifetime as the metadata; read by the batch runner
        (input) and `GET /v1/files/{id}/content`.
        """
        return f"{self.prefix}:file:{{{file_id}}}:content"

    @property
    def files(self) -> str:
        """ZSET `skyline:files` — file id -> created_at (Unix s), every file: `GET /v1/files` of an
        operator (or of a gateway without keys). Written with each file; members whose hash expired
        are dropped by the listing; the set expires `batch.file_ttl_s` after its newest member."""
        return f"{self.prefix}:files"

    def files_of(self, owner: str) -> str:
        """ZSET `skyline:files:<owner digest>` — the same for the files of one API key (what
        `GET /v1/files` lists for it, without reading other tenants' entries)."""
        return f"{self.prefix}:files:{owner}"

    def batch(self, batch_id: str) -> str:
        """HASH `skyline:batch:{<id>}` — one batch: status, timestamps, file ids, request counts, errors.

        Created by the gateway (`POST /v1/batches`); status moves through
        validating -> in_progress -> finalizing -> completed (or failed,
        cancelling -> cancelled, expired) by Lua transitions in the gateway
        and the batch runner; `completed`/`failed` are counted with each
        recorded result; `owner` as on files. TTL `batch.file_ttl_s` once
        finished.
        """
        return f"{self.prefix}:batch:{{{batch_id}}}"

    @property
    def batches(self) -> str:
        """ZSET `skyline:batches` — batch id -> created_at (Unix s), for `GET /v1/batches`.

        Written by the gateway at creation; members whose hash expired are
        dropped by the listing; the set expires a completion window + `batch.file_ttl_s`
        after its newest member. Every batch: an operator's list.
        """
        return f"{self.prefix}:batches"

    def batches_of(self, owner: str) -> str:
        """ZSET `skyline:batches:<owner digest>` — the same for the batches of one API key."""
        return f"{self.prefix}:batches:{owner}"

    def batch_results(self, batch_id: str) -> str:
        """HASH `skyline:batch:{<id>}:results` — input line number -> its output line (JSON).

        The batch's durable progress: HSETNX'd once per line (a result or an
        error), by the gateway as soon as a request finishes (so a runner
        killed mid-request loses nothing) or by the runner (bad lines, given
        up, cancelled). A restarted runner skips every line present here.
        Read at finalisation to write the output and error files. Same TTL as
        the batch.
        """
        return f"{self.prefix}:batch:{{{batch_id}}}:results"

    def batch_claim(self, batch_id: str, line: int) -> str:
        """STRING `skyline:batch:{<id>}:claim:<line>` — a gateway is running this line now.

        SET NX by the gateway before it runs a batch line, deleted when the
        result is recorded; its TTL (`gateway.request_timeout_s` + 30 s)
        frees the line if that gateway dies. A runner that finds the line
        claimed waits for its result instead of sending it twice.
        """
        return f"{self.prefix}:batch:{{{batch_id}}}:claim:{line}"

    def batch_queue(self) -> str:
        """The RQ queue of batch jobs, `<prefix>-batches`; RQ owns its keys (`rq:queue:skyline-batches`,
        `rq:wip:...`, `rq:job:<batch id>`...): `rq info` and the RQ registries show batches there."""
        return f"{self.prefix}-batches"

    # ---- the Responses API's store (gateway/response_store.py). A response's keys carry its id as
    # a hash tag, a tenant's accounting its owner: each script touches one slot.

    def response(self, response_id: str) -> str:
        """HASH `skyline:response:{<id>}` — one stored response of the Responses API.

        `owner` (the creating key's digest; "" without keys), `status` (queued, in_progress,
        completed, incomplete, failed, cancelled), `response` (the response object, JSON, as
        `GET /v1/responses/{id}` answers it), `messages` (the conversation vLLM rendered, JSON: what
        `previous_response_id` continues), `input` (the input items, JSON), `bytes`, `created_at`,
        `version`; a background response also `lease_ms` (renewed by the gateway running it; past
        it, readers mark the response failed) and `stream` ("1": its events are kept). Written by
        the gateway that made it (status changes are Lua transitions), read by every gateway.
        TTL `gateway.response_store_ttl_s`.
        """
        return f"{self.prefix}:response:{{{response_id}}}"

    def response_events(self, response_id: str) -> str:
        """LIST `skyline:response:{<id>}:events` — a background stream's events, one JSON object each.

        Entry k is the event of `sequence_number` k, RPUSHed by the gateway running the response;
        read by `GET /v1/responses/{id}?stream=true&starting_after=N` on any gateway. Same TTL as
        the response.
        """
        return f"{self.prefix}:response:{{{response_id}}}:events"

    def responses_of(self, owner: str) -> str:
        """ZSET `skyline:responses:{<owner digest>}` — response id -> when it expires (Unix ms), the
        stored responses of one API key (`-`: a gateway without keys). With `response_bytes_of`,
        what bounds a tenant's share of the store (`gateway.response_store_max_bytes`); expired
        members are dropped by the next write. TTL: the newest member's."""
        return f"{self.prefix}:responses:{{{owner or '-'}}}"

    def response_bytes_of(self, owner: str) -> str:
        """HASH `skyline:responses:{<owner digest>}:bytes` — response id -> its bytes, and `total`.

        Updated with `responses_of` by one Lua script (same hash tag); read by `redis-cli HGET ...
        total` to see a tenant's use."""
        return f"{self.prefix}:responses:{{{owner or '-'}}}:bytes"

    def all_streams(self, tiers: tuple[str, ...]) -> list[tuple[str, str, str]]:
        """(stage, tier, key) for every tier stream, in stage then tier order (retry lanes: `lanes`)."""
        return [(stage, tier, self.stream(stage, tier)) for stage in STAGES for tier in tiers]

    def lanes(self, stage: str, tiers: tuple[str, ...]) -> list[tuple[str, str]]:
        """(tier, key) of every stream a stage's workers read: each tier's stream, then its retry lane."""
        return [(tier, key) for tier in tiers for key in (self.stream(stage, tier), self.retry_stream(stage, tier))]

    @staticmethod
    def group(stage: str) -> str:
        return PREFILL_GROUP if stage == "prefill" else DECODE_GROUP
