"""Every Redis key and channel Skyline uses, built in one place.

Read this file as the map of the keyspace; `redis-cli` output should read
like it. Each entry gives the Redis type, who writes it, who reads it and its
lifetime. `prefix` (default "skyline") lets several fleets share one Redis.

Redis Cluster: a prefill worker waits on all tier streams of one stage with a
single multi-key XREAD, so all streams of a stage carry the same hash tag
(`{prefill}` / `{decode}`) and live on one shard. Pub/sub channels are not
slotted. Per-request and per-worker keys are single-key operations and spread
freely across shards.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_GROUP = "prefill"  # consumer group on every prefill tier stream
DECODE_GROUP = "decode"  # consumer group on every decode tier stream
STAGES = ("prefill", "decode")


@dataclass(frozen=True)
class Keys:
    prefix: str = "skyline"

    def stream(self, stage: str, tier: str) -> str:
        """STREAM `skyline:{prefill}:interactive` — work waiting for a stage, one per SLO tier.

        Written by the gateway (prefill, or decode for colocated routing) and
        by prefill workers (decode); read by the stage's consumer group.
        Entries: readable summary fields + `msg` (msgpack). Trimmed by MAXLEN.
        """
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        return f"{self.prefix}:{{{stage}}}:{tier}"

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
        """HASH `skyline:worker:<id>` — role, engine, model, load, address. TTL = 3 heartbeats."""
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def backlog(self) -> str:
        """HASH `skyline:backlog` — `<stage>:<tier>` -> prompt tokens admitted and not yet prefilled.

        HINCRBY'd by whoever enqueues work that needs a prefill, decremented by
        the worker when it acks the entry (queued + in progress, so a burst
        sees the work already handed to engines); read by admission control.
        An estimate (a crash between XACK and HINCRBY skews it), clamped at 0.
        """
        return f"{self.prefix}:backlog"

    @staticmethod
    def backlog_field(stage: str, tier: str) -> str:
        return f"{stage}:{tier}"

    @property
    def dead(self) -> str:
        """STREAM `skyline:dead` — requests that could not be processed (poison / failed), for humans."""
        return f"{self.prefix}:dead"

    def all_streams(self, tiers: tuple[str, ...]) -> list[tuple[str, str, str]]:
        """(stage, tier, key) for every work stream, in stage then tier order."""
        return [(stage, tier, self.stream(stage, tier)) for stage in STAGES for tier in tiers]

    @staticmethod
    def group(stage: str) -> str:
        return PREFILL_GROUP if stage == "prefill" else DECODE_GROUP
