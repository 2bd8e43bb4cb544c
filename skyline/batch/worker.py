"""`skyline batch-runner`: an RQ worker for the batch queue whose jobs survive its death.

RQ (3.x) detects an abandoned job by its entry in the queue's
StartedJobRegistry: the score is an expiry time, pushed forward by the
worker's heartbeats; RQ's maintenance (`clean_registries`, run by idle
workers every `maintenance_interval`) treats an entry past its expiry as
abandoned (AbandonedJobError) and retries the job if it has retries left.
Stock settings would take minutes to notice a dead runner: a `SimpleWorker`
does not heartbeat while its job runs (the entry lives for the job timeout,
hours for a batch) and the forking `Worker` heartbeats every 30 s with a
60 s grace. This worker therefore:

- runs the job in its own process (no fork: a `kill -9` takes the job with it,
  nothing keeps sending on its behalf),
- heartbeats the job from a thread every `batch.heartbeat_s` with a
  registry lease of `batch.lease_s`,
- wakes from its queue wait every `batch.maintenance_interval_s` and runs
  RQ's maintenance that often, so a job abandoned by a dead runner is retried
  by a live one within about lease + interval,
- on SIGTERM/Ctrl-C stops the running batch at once (the gateway still
  records the requests in flight) and lets RQ re-enqueue it,
- and ends within STOP_GRACE_S of that signal whatever RQ's shutdown meets.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from redis.exceptions import RedisError
from rq import Queue, SimpleWorker
from rq.worker import WorkerStatus

from skyline.batch import runner
from skyline.batch.jobs import rq_connection
from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys

log = logging.getLogger("skyline.batch")

# RQ stops an idle worker by raising from its signal handler, wherever the main thread is: raised
# inside redis-py's connection-pool lock, it leaves the lock held and the shutdown that follows
# (register_death) waits on it for ever. Its shutdown also writes to Redis through a client without
# a socket timeout, which a stopped Redis never answers. Past this grace the runner exits without RQ's
# bookkeeping; a batch it was running is then abandoned and retried after its lease, as after kill -9.
STOP_GRACE_S = 10.0


class BatchRunnerWorker(SimpleWorker):
    def __init__(self, *args, lease_s: int, heartbeat_s: float, stopping: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.stopping = stopping

    def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:
        # The StartedJobRegistry entry expires this long after the last heartbeat.
        return self.lease_s

    def execute_job(self, job, queue) -> None:
        execution = self.prepare_execution(job)
        done = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(job, execution, done), daemon=True,
                                name="batch-heartbeat")
        beat.start()
        try:
            self.perform_job(job, queue, execution)
        finally:
            done.set()
            beat.join()
        self.set_state(WorkerStatus.IDLE)

    def _heartbeat(self, job, execution, done: threading.Event) -> None:
        while not done.wait(self.heartbeat_s):
            try:
                self.maintain_heartbeats(job, execution)
            except RedisError as exc:  # a missed beat is not fatal; a lease's worth of them is
                log.warning("batch %s: heartbeat failed: %s", job.id, exc)

    def request_stop(self, signum, frame) -> None:
        _STOP_WATCH.signalled()  # first: takes no lock (the handler may have interrupted a lock's holder)
        self.stopping.set()  # the running batch stops sending and fails on purpose: RQ re-enqueues it
        super().request_stop(signum, frame)


class _StopWatch:
    """Ends the process `grace_s` after the first stop signal if it has not ended by then.

    Started before the worker runs and lock-free on both sides: a signal handler only stores a time,
    and the watching thread only sleeps, reads it and exits (no logging: the logging lock may be
    held by the main thread it is rescuing)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.since: float | None = None

    def signalled(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def start(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="stop-watch").start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            if self.since is not None and time.monotonic() - self.since > self.grace_s:
                try:
                    os.write(2, b"batch runner: still stopping %d s after the stop signal; exiting\n" % self.grace_s)
                except OSError:  # stderr's pipe may be gone with the launcher
                    pass
                os._exit(1)


_STOP_WATCH = _StopWatch(STOP_GRACE_S)


def gateway_url(cfg: SkylineConfig) -> str:
    if cfg.batch.gateway_url:
        return cfg.batch.gateway_url.rstrip("/")
    host = cfg.gateway.host if cfg.gateway.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"http://{host}:{cfg.gateway.port}"


def runner_key(cfg: SkylineConfig) -> str | None:
    """The key the runner sends: an operator key runs every tenant's batches (gateway/tenants.py); a tenant
    key only that tenant's (the gateway answers 404 for the others' as for missing batches)."""
    g = cfg.gateway
    if g.api_keys and not g.operator_api_keys:
        log.warning("batch runner: no operator key (gateway.operator_api_keys, SKYLINE_OPERATOR_API_KEYS); "
                    "with the first API key it can run only that key's batches")
    return (g.operator_api_keys or g.api_keys or (None,))[0]


def main(cfg: SkylineConfig, name: str | None = None, burst: bool = False) -> None:
    """Work the batch queue until stopped (or, with `burst`, until it is empty)."""
    bc = cfg.batch
    keys = Keys(cfg.key_prefix)
    conn = rq_connection(cfg.redis)
    stopping = threading.Event()
    runner.configure(runner.RunnerContext(cfg, gateway_url(cfg), runner_key(cfg), stopping))
    worker = BatchRunnerWorker(
        [Queue(keys.batch_queue(), connection=conn)], connection=conn,
        name=name or f"batch-runner-{socket.gethostname()}-{os.getpid()}",
        # The queue wait ends every maintenance interval (RQ waits worker_ttl - 15 s), so
        # maintenance (abandoned-job detection) runs that often even on an idle runner.
        worker_ttl=bc.maintenance_interval_s + 15,
        maintenance_interval=bc.maintenance_interval_s,
        lease_s=bc.lease_s, heartbeat_s=bc.heartbeat_s, stopping=stopping,
    )
    log.info("batch runner %s: queue %s, gateway %s, tier %s", worker.name, keys.batch_queue(), gateway_url(cfg),
             bc.tier)
    _STOP_WATCH.start()
    worker.work(burst=burst, logging_level=logging.getLevelName(logging.getLogger().level))
