"""The RQ side of batches: one RQ job per batch on the `<prefix>-batches` queue.

The job id is the batch id, so `rq info`, the RQ registries (queued, started,
failed, finished) and `Job.fetch(batch_id)` all name batches the way the API
does. RQ is synchronous; the gateway calls these functions in a thread.
"""

from __future__ import annotations

from typing import Any

import redis
from rq import Callback, Queue, Retry
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus

from skyline.batch.objects import COMPLETION_WINDOWS
from skyline.core.config import BatchConfig, RedisConfig
from skyline.core.keys import Keys
from skyline.core.redisconn import CLUSTER, SENTINEL, SENTINEL_KWARGS, target_of, tls_options

RUN_BATCH = "skyline.batch.runner.run_batch_job"  # by name: the gateway never imports the runner
ON_FAILURE = "skyline.batch.runner.on_job_failure"
SAFETY_MARGIN_S = 3600  # RQ's own timeout, past the completion window (the runner ends expired batches itself)


def rq_connection(cfg: RedisConfig) -> redis.Redis:
    """A synchronous client for RQ, from the same settings as every other connection.

    RQ runs multi-key Lua scripts across its own keys, which Redis Cluster
    cannot do; batch jobs need a single server or Sentinel.
    """
    t = target_of(cfg)
    common: dict[str, Any] = {"username": t.username or None, "password": t.password or None, **tls_options(cfg)}
    if t.topology == CLUSTER:
        raise ValueError("batch jobs run on RQ, which does not support Redis Cluster; use a single server or Sentinel")
    if t.topology == SENTINEL:
        from redis.sentinel import Sentinel

        return Sentinel(list(t.nodes), sentinel_kwargs=SENTINEL_KWARGS, db=t.db, **common).master_for(t.master_name)
    if t.unix_path:
        return redis.Redis(unix_socket_path=t.unix_path, db=t.db,
                           **{k: v for k, v in common.items() if not k.startswith("ssl")})
    host, port = t.nodes[0]
    return redis.Redis(host=host, port=port, db=t.db, **common)


def enqueue_batch(conn: redis.Redis, keys: Keys, cfg: BatchConfig, batch_id: str, window: str, total: int) -> str:
    """Queue the batch's job; returns the RQ job id (the batch id)."""
    queue = Queue(keys.batch_queue(), connection=conn)
    keep = cfg.file_ttl_s or -1  # RQ: -1 = keep forever
    job = queue.enqueue(
        RUN_BATCH, batch_id, keys.prefix,
        job_id=batch_id,
        description=f"batch {batch_id}: {total} requests",
        retry=Retry(max=cfg.job_retries),  # runner failed, stopped or died (abandoned): run again, it resumes
        job_timeout=COMPLETION_WINDOWS[window] + SAFETY_MARGIN_S,
        result_ttl=keep,
        failure_ttl=keep,
        on_failure=Callback(ON_FAILURE),
    )
    return job.id


def job_status(conn: redis.Redis, job_id: str) -> str | None:
    """The RQ job's status (queued, started, finished, failed, ...), None if RQ no longer has it."""
    try:
        status = Job.fetch(job_id, connection=conn).get_status()
    except NoSuchJobError:
        return None
    return str(status.value if hasattr(status, "value") else status)


def cancel_queued(conn: redis.Redis, job_id: str) -> bool:
    """Take a batch's job off the queue if no runner has started it; True if it was taken off."""
    try:
        job = Job.fetch(job_id, connection=conn)
        if job.get_status() not in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
            return False
        job.cancel()
    except (NoSuchJobError, InvalidJobOperation):
        return False
    return True
