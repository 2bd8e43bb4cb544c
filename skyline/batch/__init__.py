"""Batch jobs: OpenAI Batch API files and batches, run as RQ jobs in the `batch` SLO tier.

  jsonl.py   input files -> requests and per-line errors; output lines (pure)
  objects.py OpenAI file and batch objects from their Redis hashes (pure)
  store.py   files, batches and per-line results in Redis
  jobs.py    the RQ side: enqueue a batch, cancel a queued one
  runner.py  the RQ job: send a batch's remaining lines at a paced concurrency
  worker.py  `skyline batch-runner`, an RQ worker that heartbeats its job
  cli.py     `skyline batch submit|status`
"""
