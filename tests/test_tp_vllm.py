"""Tensor parallelism on this machine's CPU build, against plain `vllm serve` (TP=1).

The default model has 9 attention heads (3 KV heads): vLLM refuses TP=2 for it, TP=3 is the smallest
split it takes (docs/vllm-on-cpu.md). Two fleets, one after the other: a TP=1 prefill engine with a
TP=3 decode engine, then a TP=3 prefill engine with a TP=1 decode engine (three rank processes, one
core set per rank; each engine on a core of its own). Greedy answers equal plain `vllm serve`'s (TP=1),
token for token, streamed and not: through the colocated route (the decode engine alone) and through
the disaggregated one, where the KV computed at one TP is pulled over NIXL by engine ranks of another
(heterogeneous TP: vLLM's connector maps one rank's KV heads onto three ranks, or three onto one).

The reference server is stopped before the fleets start: four engine ranks on two cores are enough
at once.
"""

from __future__ import annotations

import os

import openai
import pytest

from tests.fleet import Fleet
from tests.vllm_reference import greedy_answer, reference_server, wait_up

pytestmark = pytest.mark.vllm

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12  # one TP=3 step on shared cores is ~10x a TP=1 one: a few tokens prove the split


def _answer(client, kind: str, stream: bool, route: str | None = None) -> tuple[str, dict]:
    return greedy_answer(client, MODEL, kind, stream, route, MAX_TOKENS)


@pytest.fixture(scope="module")
def reference_answers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp-reference")
    with reference_server(MODEL, (), logs / "reference.log") as (proc, url):
        wait_up(proc, url, logs / "reference.log")
        ref = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        return {kind: _answer(ref, kind, False)[0] for kind in ("chat", "completion")}


# Each layout: (the prefill engine's ranks, the decode engine's), each engine on a core of its own: ranks
# of a decode engine on its prefill peer's core hang its KV pulls (skyline/tools/launcher.py core_binds;
# the stalls this test saw on 2026-12-06 had the TP=3 ranks bound to "1|0|1").
LAYOUTS = {"tp1-to-tp3": (1, 3), "tp3-to-tp1": (3, 1)}


def _bind(core: int, ranks: int) -> str:
    return "|".join([str(core)] * ranks)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def fleet(request, redis_url, tmp_path_factory, reference_answers):
    prefill_tp, decode_tp = LAYOUTS[request.param]
    f = Fleet(redis_url, f"tp-vllm-{request.param}", "vllm", tmp_path_factory.mktemp(f"tp-logs-{request.param}"),
              ["--model", "default"])
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    workers = {"prefill-0": ("prefill", "--cpu-bind", _bind(first, prefill_tp), "--tensor-parallel-size",
                             str(prefill_tp)),
               "decode-0": ("decode", "--cpu-bind", _bind(last, decode_tp), "--tensor-parallel-size", str(decode_tp))}
    with f.running(workers, timeout_s=600):
        yield f


def test_the_colocated_route_answers_as_plain_vllm_serve(fleet, reference_answers):
    """The decode engine computes the prompt and decodes it: three ranks in one layout, one in the other."""
    sky = fleet.client(timeout_s=300)
    for kind in ("chat", "completion"):
        text, ext = _answer(sky, kind, False, "colocated")
        assert text == reference_answers[kind], (kind, ext)
        assert ext["decode_worker"] == "decode-0" and not ext["kv_transfer"].get("remote_prefill"), ext
        assert _answer(sky, kind, True, "colocated")[0] == reference_answers[kind], (kind, "stream")


def test_kv_computed_at_one_tp_is_decoded_at_another(fleet, reference_answers):
    """Heterogeneous TP over NIXL: the decode engine's ranks pull the KV heads they hold from the prefill
    engine's ranks (vLLM's NIXL connector maps one rank onto several, or several onto one)."""
    sky = fleet.client(timeout_s=300)
    for kind in ("chat", "completion"):
        text, ext = _answer(sky, kind, False, "disagg")
        assert ext["kv_transfer"].get("remote_prefill"), ext
        assert (ext["prefill_worker"], ext["decode_worker"]) == ("prefill-0", "decode-0"), ext
        assert text == reference_answers[kind], (kind, ext)
        assert _answer(sky, kind, True, "disagg")[0] == reference_answers[kind], (kind, "stream")
