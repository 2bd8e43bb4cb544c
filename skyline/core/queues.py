"""What the work streams hold: length, pending, lag, consumers and the prefill backlog per
stage and tier, in one pipelined round trip. Read by the gateway's /metrics and /dashboard
and by `skyline status`; by hand with XINFO GROUPS (docs/operations.md)."""

from __future__ import annotations

from dataclasses import dataclass

from skyline.core.keys import STAGES, Keys


@dataclass
class StreamStatus:
    stage: str
    tier: str
    key: str
    length: int
    pending: int
    lag: int | None
    consumers: int
    backlog_tokens: int = 0  # prompt tokens admitted and not yet prefilled (skyline:backlog)
    # Entries no worker has claimed yet: the queue depth. `length` counts acked entries too
    # (streams are only trimmed by MAXLEN), so it is no measure of waiting work.
    waiting: int = 0


# Redis < 7 reports no group lag; waiting entries are then counted with a bounded XRANGE
# (a deeper queue shows as this many).
WAITING_COUNT_CAP = 1000


async def read_streams(r, keys: Keys, tiers: tuple[str, ...]) -> list[StreamStatus]:
    """Length, pending, lag and consumers of every work stream, and the prefill backlog
    in tokens: one pipelined round trip (the gateway's /metrics and /dashboard call it
    on every scrape/poll, plus one for the list of affinity lanes). A tier's retry lane
    (work returned to the queue) and its affinity lanes (work placed for one worker's
    prefix cache) are counted with its stream: one row per stage and tier."""
    pipe = r.pipeline(transaction=False)
    for stage in STAGES:
        pipe.smembers(keys.affinity_lanes(stage))
    placed = await pipe.execute(raise_on_error=False)
    streams = [(stage, tier, key) for stage in STAGES for tier, key in keys.lanes(stage, tiers)]
    for stage, holders in zip(STAGES, placed):
        if isinstance(holders, (set, list)):
            streams += [(stage, t, keys.affinity_lane(stage, t, _s(w))) for w in sorted(holders) for t in tiers]
    pipe = r.pipeline(transaction=False)
    for _stage, _tier, key in streams:
        pipe.xlen(key)
        pipe.xinfo_groups(key)
    pipe.hgetall(keys.backlog)
    results = await pipe.execute(raise_on_error=False)
    backlog = {_s(k): int(v) for k, v in (results[-1] or {}).items()} if isinstance(results[-1], dict) else {}
    out, uncounted = [], []
    for i, (stage, tier, key) in enumerate(streams):
        length, groups = results[2 * i], results[2 * i + 1]
        pending = consumers = 0
        lag: int | None = None
        last_delivered = None
        if isinstance(groups, list):  # an error (stream not created yet: no worker of this stage started)
            for g in groups:
                if _s(g["name"]) == Keys.group(stage):
                    pending, consumers, lag = int(g["pending"]), int(g["consumers"]), g.get("lag")
                    last_delivered = _s(g["last-delivered-id"])
        st = StreamStatus(stage, tier, key, length if isinstance(length, int) else 0, pending, lag, consumers,
                          max(0, backlog.get(Keys.backlog_field(stage, tier), 0)))
        if lag is not None:
            st.waiting = int(lag)
        elif last_delivered is not None and st.length:
            uncounted.append((st, last_delivered))
        out.append(st)
    if uncounted:
        pipe = r.pipeline(transaction=False)
        for st, last in uncounted:
            pipe.xrange(st.key, f"({last}", "+", count=WAITING_COUNT_CAP)
        for (st, _), entries in zip(uncounted, await pipe.execute(raise_on_error=False)):
            st.waiting = len(entries) if isinstance(entries, list) else 0
    rows = {(st.stage, st.tier): st for st in out if st.key == keys.stream(st.stage, st.tier)}
    for st in out:
        row = rows[(st.stage, st.tier)]
        if st is not row:  # the tier's retry lane, or an affinity lane
            row.length += st.length
            row.pending += st.pending
            row.waiting += st.waiting
            row.consumers = max(row.consumers, st.consumers)
            if row.lag is not None and st.lag is not None:
                row.lag += st.lag
    return list(rows.values())


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def fleet_models(workers: list, default_model: str) -> dict[str, str]:
    """keyspace -> served name of every model whose queues there are to read: the default model's plain
    keys ("", named by a live worker of it, else `default_model`) and each live worker's model's."""
    models = {"": next((w.model for w in workers if not w.keyspace), default_model)}
    for w in workers:
        models.setdefault(w.keyspace, w.model)
    return models


async def read_model_streams(r, keys: Keys, tiers: tuple[str, ...], models: dict[str, str]) -> list[dict]:
    """`read_streams` of each model of `models` (`fleet_models`), each row a dict with its model's name."""
    from dataclasses import asdict

    return [{**asdict(s), "model": name} for keyspace, name in models.items()
            for s in await read_streams(r, keys.for_model(keyspace), tiers)]
