"""The routes of `vllm serve` (a generative model) that the gateway does not serve, each refused with why.

A client that calls one gets 501 and the reason, not a 404 that reads as a wrong URL. The list is
checked against the routes vLLM's own app has (tests/test_vllm_routes.py): a route a vLLM upgrade
adds must be served or named here.
"""

from __future__ import annotations

from fastapi import FastAPI

from skyline.gateway.errors import ApiError

_SCALE_OUT = ("vLLM's scale-out endpoints (render without generating, token-in generate) are not served by "
              "Skyline: its gateway renders every request and its workers generate; use /tokenize to render, "
              "and the OpenAI routes to generate")

# path: (methods, why)
UNSERVED: dict[str, tuple[tuple[str, ...], str]] = {
    "/v1/chat/completions/render": (("POST",), _SCALE_OUT),
    "/v1/completions/render": (("POST",), _SCALE_OUT),
    "/v1/responses/render": (("POST",), _SCALE_OUT),
    "/v1/messages/render": (("POST",), _SCALE_OUT),
    "/v1/chat/completions/derender": (("POST",), _SCALE_OUT),
    "/v1/completions/derender": (("POST",), _SCALE_OUT),
    "/inference/v1/generate": (("POST",), _SCALE_OUT),
    "/inference/v1/abort_requests": (("POST",), _SCALE_OUT),
    "/scale_elastic_ep": (("POST",), "elastic expert parallelism rescales one vLLM engine; a Skyline fleet scales "
                                     "by starting and stopping worker processes"),
    "/is_scaling_elastic_ep": (("POST",), "elastic expert parallelism rescales one vLLM engine; a Skyline fleet "
                                          "scales by starting and stopping worker processes"),
    "/kv_event_sources": (("GET",), "each engine's KV cache events go to its own worker, which keeps the fleet's "
                                    "view in Redis (skyline:kvcache:<worker>, docs/operations.md)"),
}


def add_routes(app: FastAPI) -> None:
    for path, (methods, why) in UNSERVED.items():
        app.add_api_route(path, _refuse(path, why), methods=list(methods), include_in_schema=False)


def _refuse(path: str, why: str):
    async def refuse() -> None:
        raise ApiError(501, f"{path}: {why}", code="not_served")
    return refuse
