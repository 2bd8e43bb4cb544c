"""The Skyline gateway: OpenAI-compatible HTTP in front of the Redis work streams.

Module map (one concept each):
- `app`        create_app(): routes and the request path, lifespan (Redis, relay, fleet view)
- `server`     serve(): uvicorn with uvloop/httptools
- `prepare`    auth, body limit, parse, tokenize, context checks, SLO, route -> GenerateRequest
- `schemas`    pydantic request models (HTTP edge only)
- `errors`     OpenAI error JSON, ApiError, exception handlers
- `relay`      one pub/sub connection, frames to per-request queues
- `session`    one request in flight: timeouts, latency, cancel on abandonment
- `responses`  OpenAI response bodies and SSE chunks
- `fleetview`  cached set of live worker roles
- `metrics`    Prometheus metrics
- `testing`    run a real gateway in a thread (tests, benchmarks)
"""
