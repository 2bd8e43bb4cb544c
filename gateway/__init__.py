"""The Skyline gateway: OpenAI-compatible HTTP in front of the Redis work streams.

Module map (one concept each):
- `app`        create_app(): routes around vLLM's serving calls, lifespan (Redis, relay, fleet view)
- `server`     serve(): uvicorn with uvloop/httptools
- `openai_api` vLLM's OpenAI serving layer (chat, completions, responses, tokenize) built over the fleet
- `fleet_client` vLLM's EngineClient interface answered by the fleet: checks, SLO, admission, frames
- `outputs`    the fleet's frames as vLLM RequestOutputs (delta / cumulative / final)
- `dispatch`   into the fleet: live workers, admission, subscribe, enqueue
- `prepare`    auth, body limit, the `slo` extension, SLO, route -> GenerateRequest
- `errors`     OpenAI error JSON, ApiError, exception handlers (vLLM's errors as vLLM answers them)
- `relay`      one pub/sub connection, frames to per-request queues
- `resp`       RESP2 as the relay speaks it
- `resume`     catching streams up from their frame logs after the relay lost its connection
- `session`    one request in flight: timeouts, latency, cancel on abandonment
- `fleetview`  cached set of live worker roles
- `metrics`    Prometheus metrics
- `testing`    run a real gateway in a thread (tests, benchmarks)
"""
