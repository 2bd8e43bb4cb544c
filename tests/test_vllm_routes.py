"""Every route `vllm serve` has for a generative model is served by the gateway or refused with why.

vLLM's own app is built (as `vllm serve` builds it, over no engine: the routes only) beside the
gateway's; a route a vLLM upgrade adds fails this test until it is served or named in
gateway/unserved.py.
"""

from __future__ import annotations

import httpx
import pytest

from skyline.core.config import load_config
from skyline.core.sim_model import sim_model_dir
from skyline.gateway.testing import GatewayThread, announce_workers
from skyline.gateway.unserved import UNSERVED

MODEL = "skyline-sim"
# vllm serve's API documentation pages: the gateway serves no OpenAPI schema (it would describe vLLM's
# request models, which it validates with, but not Skyline's headers and answers).
DOCS = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def _routes(app) -> set[tuple[str, str]]:
    return {(m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or ()) if m != "HEAD"}


@pytest.fixture(scope="module")
def gateway(redis_url):
    from dataclasses import replace

    from skyline.core.keys import Keys

    cfg = load_config(None)
    cfg = replace(cfg, key_prefix="routes-test", redis=replace(cfg.redis, url=redis_url))
    announce_workers(redis_url, Keys("routes-test"), "prefill", "decode")
    with GatewayThread(cfg, None, MODEL, 256) as gw:
        yield gw


def test_every_vllm_serve_route_is_served_or_refused_with_why(gateway):
    from vllm.engine.arg_utils import EngineArgs

    from skyline.gateway.vllm_serving_internals import api_server_app

    model_dir = str(sim_model_dir())
    vllm_app, _ = api_server_app(["--model", model_dir], None,
                                 EngineArgs(model=model_dir, max_model_len=256).create_model_config())
    ours = _routes(gateway.app)
    missing = sorted((m, p) for m, p in _routes(vllm_app) if p not in DOCS and (m, p) not in ours)
    assert not missing, f"vllm serve routes the gateway neither serves nor refuses: {missing}"


@pytest.mark.parametrize("path", sorted(UNSERVED))
def test_an_unserved_route_says_why(gateway, path):
    methods, why = UNSERVED[path]
    r = httpx.request(methods[0], gateway.url + path, json={}, timeout=30)
    assert r.status_code == 501 and why in r.json()["error"]["message"], r.text


def test_version_and_load_as_vllm_serve_answers_them(gateway):
    import vllm

    assert httpx.get(gateway.url + "/version", timeout=30).json()["version"] == vllm.__version__
    assert httpx.get(gateway.url + "/load", timeout=30).json() == {"server_load": 0}
    assert httpx.get(gateway.url + "/ping", timeout=30).status_code == 200
