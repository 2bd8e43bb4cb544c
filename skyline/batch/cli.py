"""`skyline batch submit|status|output` and `skyline batch-runner`: argparse wiring and the client commands.

The client commands talk to the gateway's OpenAI Batch API with the `openai`
client (what users would write themselves); `status` adds what RQ says about
the batch's job.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from skyline.core.config import SkylineConfig

TERMINAL = ("failed", "completed", "expired", "cancelled")


def add_parsers(sub, common: Callable[[argparse.ArgumentParser], None]) -> None:
    run = sub.add_parser("batch-runner", help="run batch jobs (an RQ worker on the <prefix>-batches queue)")
    common(run)
    run.add_argument("--gateway-url", help="gateway the runner sends requests to (default http://<gateway host>:<port>)")
    run.add_argument("--api-key", action="append", help="API key for the gateway (env SKYLINE_API_KEYS)")
    run.add_argument("--name", help="RQ worker name (default batch-runner-<host>-<pid>)")
    run.add_argument("--burst", action="store_true", help="exit once the queue is empty")

    bt = sub.add_parser("batch", help="submit a batch file, follow it, read its output (OpenAI Batch API)")
    bsub = bt.add_subparsers(dest="batch_command", required=True)
    for name, help_text in (("submit", "upload a JSONL file and create a batch"),
                            ("status", "show a batch (and its RQ job)"),
                            ("output", "print a batch's output (or error) file")):
        p = bsub.add_parser(name, help=help_text)
        common(p)
        p.add_argument("target", metavar="FILE" if name == "submit" else "BATCH_ID")
        p.add_argument("--gateway-url", help="gateway URL (default http://<gateway host>:<port>)")
        p.add_argument("--api-key", action="append", help="API key (env SKYLINE_API_KEYS)")
        if name == "submit":
            p.add_argument("--endpoint", help="default: the url of the file's first request")
            p.add_argument("--metadata", action="append", default=[], help="KEY=VALUE (repeatable)")
        if name in ("submit", "status"):
            p.add_argument("--wait", action="store_true", help="follow the batch until it ends")
            p.add_argument("--json", action="store_true", help="print the batch object as JSON")
        if name == "output":
            p.add_argument("--errors", action="store_true", help="the error file instead of the output file")


def main(args: argparse.Namespace, cfg: SkylineConfig) -> None:
    from dataclasses import replace

    if getattr(args, "gateway_url", None):
        cfg = replace(cfg, batch=replace(cfg.batch, gateway_url=args.gateway_url))
    if args.command == "batch-runner":
        from skyline.batch.worker import main as runner_main

        runner_main(cfg, name=args.name, burst=args.burst)
        return
    import logging

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the openai client's HTTP library: a line per call
    client = _client(cfg)
    if args.batch_command == "submit":
        batch = _submit(client, Path(args.target), args.endpoint, args.metadata)
    elif args.batch_command == "status":
        batch = client.batches.retrieve(args.target)
    else:
        batch = client.batches.retrieve(args.target)
        file_id = batch.error_file_id if args.errors else batch.output_file_id
        if not file_id:
            sys.exit(f"batch {batch.id} is {batch.status} and has no {'error' if args.errors else 'output'} file")
        sys.stdout.write(client.files.content(file_id).text)
        return
    _show(batch, cfg, args.json)
    while args.wait and batch.status not in TERMINAL:
        time.sleep(2)
        batch = client.batches.retrieve(batch.id)
        _show(batch, cfg, args.json)


def _client(cfg: SkylineConfig):
    import openai

    from skyline.batch.worker import gateway_url

    # A client: it sends the first tenant key (its batches are that tenant's), an operator key only without one.
    key = (cfg.gateway.api_keys or cfg.gateway.operator_api_keys or ("unused",))[0]
    return openai.OpenAI(base_url=gateway_url(cfg) + "/v1", api_key=key, max_retries=2)


def _submit(client, path: Path, endpoint: str | None, metadata: list[str]):
    if endpoint is None:
        first = next((line for line in path.read_text().splitlines() if line.strip()), "")
        try:
            endpoint = json.loads(first).get("url")
        except (ValueError, AttributeError):
            endpoint = None
        if not endpoint:
            sys.exit(f"{path}: cannot read the endpoint from its first line; pass --endpoint")
    pairs = dict(item.split("=", 1) for item in metadata if "=" in item)
    with path.open("rb") as fh:
        uploaded = client.files.create(file=fh, purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h",
                                 metadata=pairs or None)


def _show(batch, cfg: SkylineConfig, as_json: bool) -> None:
    if as_json:
        print(json.dumps(batch.model_dump(), indent=2))
        return
    counts = batch.request_counts
    line = (f"{batch.id}  {batch.status:<11} {counts.completed if counts else 0} completed, "
            f"{counts.failed if counts else 0} failed of {counts.total if counts else 0}")
    rq_state = _rq_status(cfg, batch.id)
    if rq_state:
        line += f"  (RQ job: {rq_state})"
    print(line, flush=True)
    if batch.status in TERMINAL:
        for label, fid in (("output file", batch.output_file_id), ("error file", batch.error_file_id)):
            if fid:
                print(f"  {label}: {fid}   (skyline batch output {batch.id}{' --errors' if 'error' in label else ''})")
        for err in (batch.errors.data if batch.errors and batch.errors.data else []):
            where = f"line {err.line}: " if err.line else ""
            print(f"  error {err.code}: {where}{err.message}")


def _rq_status(cfg: SkylineConfig, batch_id: str) -> str | None:
    """What RQ says about the batch's job; None when RQ (Redis) is not reachable from here."""
    from redis.exceptions import RedisError

    from skyline.batch.jobs import job_status, rq_connection

    try:
        return job_status(rq_connection(cfg.redis), batch_id)
    except (RedisError, OSError, ValueError):
        return None
