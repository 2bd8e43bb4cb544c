"""Differential tier: the same requests to a plain `vllm serve` and to a Skyline fleet, same answers.

Started once for this module: a plain vLLM OpenAI server on the default model
(with the tool parser flags a tool-using deployment sets) and a Skyline fleet
(gateway with the same flags, one prefill and one decode worker on real vLLM
engines, KV over NIXL). Every case goes to the reference and to Skyline through
both routes (disaggregated: prompt prefilled on the prefill engine, KV pulled
over NIXL; colocated: the decode engine does both), with the `openai` client,
and compares what a client sees: greedy text token for token, tool calls (names
and parsed arguments), JSON validity, logprobs (within a small tolerance: the
engines batch differently), choices, usage, finish reasons, error statuses.
"""

from __future__ import annotations

import json
import math
import os

import httpx
import openai
import pytest

from tests.fleet import Fleet
from tests.vllm_reference import reference_server, wait_up

pytestmark = pytest.mark.vllm

MODEL = "SmolLM2-135M-Instruct"
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
ROUTES = ("disagg", "colocated")
LOGPROB_TOL = 2e-3
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A plain vLLM OpenAI server with the same tool flags, as a user runs it."""
    log_path = tmp_path_factory.mktemp("reference") / "vllm.log"
    with reference_server(MODEL, TOOL_FLAGS, log_path) as (proc, url):
        wait_up(proc, url, log_path)
        yield url


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory, reference):
    f = Fleet(redis_url, "parity", "vllm", tmp_path_factory.mktemp("parity-logs"), ["--model", "default"],
              gateway_args=(*Fleet.EVERY_PROMPT_REMOTE, *TOOL_FLAGS))
    cores = sorted(os.sched_getaffinity(0))
    workers = {"prefill-0": ("prefill", "--cpu-bind", str(cores[0])), "decode-0": ("decode", "--cpu-bind", str(cores[-1]))}
    with f.running(workers, timeout_s=600):
        yield f


@pytest.fixture(scope="module")
def clients(fleet, reference):
    ref = openai.OpenAI(base_url=f"{reference}/v1", api_key="unused", timeout=120, max_retries=0)
    sky = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", timeout=120, max_retries=0)
    return ref, sky


def _call(client, kind: str, route: str | None, **kw):
    # The batch tier is never shed: admission control's cold-start estimate must not turn a parity case into a 429.
    headers = {"x-skyline-route": route, "x-slo-tier": "batch"} if route else None
    api = client.chat.completions if kind == "chat" else client.completions
    return api.create(model=MODEL, extra_headers=headers, **kw)


def _choices(resp, kind: str) -> list[dict]:
    """What a client reads of each choice, in order."""
    out = []
    for c in resp.choices:
        d = {"index": c.index, "finish_reason": c.finish_reason}
        if kind == "chat":
            d["content"] = c.message.content
            d["tool_calls"] = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
        else:
            d["text"] = c.text
        d["logprobs"] = _logprobs(c.logprobs, kind)
        out.append(d)
    return out


def _logprobs(lp, kind):
    if lp is None:
        return None
    if kind == "chat":
        return [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in lp.content or []]
    return [(tok, v, sorted((top or {}).items())) for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]


def _close(a, b, tol=LOGPROB_TOL) -> bool:
    """Equal, with floats within `tol` (None/inf compared exactly)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    return a == b


def _same(clients, kind: str, **kw):
    """The request to the reference and to Skyline on both routes: the same choices and usage."""
    ref, sky = clients
    want = _call(ref, kind, None, **kw)
    for route in ROUTES:
        got = _call(sky, kind, route, **kw)
        assert _close(_choices(got, kind), _choices(want, kind)), (route, _choices(got, kind), _choices(want, kind))
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == \
               (want.usage.prompt_tokens, want.usage.completion_tokens), route
        ext = got.model_extra["skyline"]
        assert all(e["route"] == route for e in (ext if isinstance(ext, list) else [ext])), route
    return want


def _streamed(clients, kind: str, **kw):
    """Streamed through Skyline (both routes) as streamed from the reference: text per choice, finish reasons."""
    ref, sky = clients

    def collect(client, route):
        texts, finishes, tools = {}, {}, {}
        for chunk in _call(client, kind, route, stream=True, **kw):
            for c in chunk.choices:
                if kind == "chat":
                    texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                    for t in c.delta.tool_calls or []:
                        name, args = tools.get((c.index, t.index), ("", ""))
                        tools[(c.index, t.index)] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
                else:
                    texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
        return texts, finishes, {k: (n, json.loads(a)) for k, (n, a) in tools.items()}

    want = collect(ref, None)
    for route in ROUTES:
        assert collect(sky, route) == want, route
    return want


# ---- 1. sampling ----------------------------------------------------------------------------------

GREEDY = dict(temperature=0, max_tokens=24)
SAMPLING_CASES = [
    ("chat", dict(messages=CHAT, **GREEDY)),
    ("completion", dict(prompt=PROMPT, **GREEDY)),
    ("chat", dict(messages=CHAT, temperature=0, max_tokens=32, stop=["Paris", "\n"])),
    ("completion", dict(prompt=PROMPT, temperature=0, max_tokens=32, stop=[" red"],
                        extra_body={"include_stop_str_in_output": True})),
    ("completion", dict(prompt=PROMPT, **GREEDY, extra_body={"stop_token_ids": [28]})),
    ("completion", dict(prompt=PROMPT, temperature=0, max_tokens=12, extra_body={"ignore_eos": True, "min_tokens": 12})),
    ("chat", dict(messages=CHAT, **GREEDY, logit_bias={"504": -100})),
    ("chat", dict(messages=CHAT, **GREEDY, extra_body={"bad_words": ["Paris"]})),
    ("completion", dict(prompt=PROMPT, **GREEDY, extra_body={"repetition_penalty": 1.3})),
    ("completion", dict(prompt=PROMPT, **GREEDY, presence_penalty=0.8, frequency_penalty=0.6)),
    ("chat", dict(messages=CHAT, temperature=1.0, max_tokens=24, extra_body={"top_k": 1})),
    ("completion", dict(prompt=PROMPT, temperature=0.8, max_tokens=24, seed=1234, top_p=0.9,
                        extra_body={"min_p": 0.05})),
    ("chat", dict(messages=CHAT, temperature=0, max_completion_tokens=10)),
    ("completion", dict(prompt=PROMPT, **GREEDY, extra_body={"allowed_token_ids": [260, 314, 1230, 28, 30, 216]})),
    ("completion", dict(prompt="one two three four five six seven eight nine ten", **GREEDY,
                        extra_body={"truncate_prompt_tokens": 4})),
    ("chat", dict(messages=CHAT, **GREEDY, extra_body={"skip_special_tokens": False,
                                                       "spaces_between_special_tokens": False})),
    ("completion", dict(prompt=[504, 3458, 282, 4649, 314], **GREEDY)),  # token ids
    ("chat", dict(messages=CHAT, **GREEDY, extra_body={"cache_salt": "tenant-a"})),
]


@pytest.mark.parametrize("kind,kw", SAMPLING_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(SAMPLING_CASES)])
def test_sampling_parameters_give_vllms_answers(clients, kind, kw):
    _same(clients, kind, **kw)


def test_cache_salt_separates_prefix_caches_on_the_engine(clients):
    _, sky = clients
    long = [{"role": "user", "content": "Salted: " + "A journey of a thousand miles begins with one step. " * 30}]

    def cached(route: str, salt: str) -> int:
        resp = _call(sky, "chat", route, messages=long, temperature=0, max_tokens=2, extra_body={"cache_salt": salt})
        return resp.model_extra["skyline"]["kv_transfer"]["num_cached_tokens"]

    cached("colocated", "tenant-a")  # computes the prompt: its blocks are cached under tenant-a's salt
    assert cached("colocated", "tenant-a") > 0
    assert cached("colocated", "tenant-b") == 0  # same prompt, another salt: no hit


@pytest.mark.parametrize("kind,kw", [SAMPLING_CASES[0], SAMPLING_CASES[2], SAMPLING_CASES[1]])
def test_streams_carry_vllms_text_and_finish_reasons(clients, kind, kw):
    _streamed(clients, kind, **kw)


# ---- 2. log probabilities --------------------------------------------------------------------------

LOGPROB_CASES = [
    ("chat", dict(messages=CHAT, **GREEDY, logprobs=True, top_logprobs=5)),
    ("chat", dict(messages=CHAT, **GREEDY, logprobs=True)),
    ("completion", dict(prompt=PROMPT, **GREEDY, logprobs=3)),
    ("completion", dict(prompt=PROMPT, temperature=0, max_tokens=4, echo=True)),
    ("completion", dict(prompt=PROMPT, temperature=0, max_tokens=4, echo=True, logprobs=2)),
    # Logprobs of named tokens at each position, beside the sampled one (vLLM's logprob_token_ids).
    ("completion", dict(prompt=PROMPT, **GREEDY, logprobs=1, extra_body={"logprob_token_ids": [260, 314, 28]})),
    ("chat", dict(messages=CHAT, **GREEDY, logprobs=True, extra_body={"logprob_token_ids": [504, 30]})),
]


@pytest.mark.parametrize("kind,kw", LOGPROB_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(LOGPROB_CASES)])
def test_logprobs_in_vllms_shapes(clients, kind, kw):
    _same(clients, kind, **kw)


def test_named_token_logprobs_are_streamed(clients):
    """A stream asking for logprob_token_ids carries them with each chunk, as vllm serve's does."""
    ref, sky = clients
    kw = dict(prompt=PROMPT, temperature=0, max_tokens=6, logprobs=1, extra_body={"logprob_token_ids": [260, 314]})

    def collect(client, route):
        return [(tok, v, sorted((top or {}).items())) for chunk in _call(client, "completion", route, stream=True, **kw)
                for c in chunk.choices if c.logprobs is not None
                for tok, v, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs)]

    want = collect(ref, None)
    assert len(want) == 6
    for route in ROUTES:
        assert _close(collect(sky, route), want), route


def test_prompt_logprobs_also_when_the_prompt_was_prefilled_on_another_engine(clients):
    ref, sky = clients
    kw = dict(prompt=PROMPT, temperature=0, max_tokens=4, extra_body={"prompt_logprobs": 2})
    want = _call(ref, "completion", None, **kw).choices[0].model_extra["prompt_logprobs"]
    assert want and len(want) > 3
    for route in ROUTES:
        got = _call(sky, "completion", route, **kw)
        assert _close(got.choices[0].model_extra["prompt_logprobs"], want), route
        assert got.model_extra["skyline"]["kv_transfer"]["remote_prefill"] is (route == "disagg")


# ---- 3. several choices -----------------------------------------------------------------------------

# vLLM refuses n > 1 with greedy sampling; seeded sampling makes each choice reproducible.
CHOICE_CASES = [
    ("chat", dict(messages=CHAT, temperature=0.8, seed=11, max_tokens=12, n=3)),
    ("completion", dict(prompt=PROMPT, temperature=0.8, seed=12, max_tokens=12, n=2)),
    ("completion", dict(prompt=[PROMPT, "The capital of Italy is"], temperature=0, max_tokens=12)),
    ("completion", dict(prompt=[PROMPT, "The capital of Italy is"], temperature=0.8, seed=13, max_tokens=8, n=2)),
]


@pytest.mark.parametrize("kind,kw", CHOICE_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CHOICE_CASES)])
def test_several_choices_in_vllms_order_and_usage(clients, kind, kw):
    want = _same(clients, kind, **kw)
    assert len(want.choices) >= 2


def test_n_on_the_disaggregated_route_pulls_the_kv_once_and_shares_it(clients):
    _, sky = clients
    long = [{"role": "user", "content": "Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 40}]
    resp = _call(sky, "chat", "disagg", messages=long, temperature=0.8, seed=5, max_tokens=8, n=3)
    kv = resp.model_extra["skyline"]["kv_transfer"]
    assert kv["remote_prefill"] is True and kv["pulled_once_for_n"] == 3 and kv["num_remote_tokens"] > 0
    assert kv["num_cached_tokens"] > 0  # the children found the pulled prompt in the decode engine's prefix cache


def test_several_choices_streamed(clients):
    _streamed(clients, "completion", prompt=[PROMPT, "The capital of Italy is"], temperature=0.8, seed=14, max_tokens=8,
              n=2)


# ---- 4. tools --------------------------------------------------------------------------------------

TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_CASES = [
    dict(messages=TOOL_ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
         temperature=0, max_tokens=48),
    dict(messages=TOOL_ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=64),
    dict(messages=TOOL_ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=24),
    dict(messages=TOOL_ASK, tools=[WEATHER, TIME], tool_choice="auto", temperature=0, max_tokens=48),
    dict(messages=TOOL_ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, temperature=0,
         max_tokens=64),
    dict(messages=[*TOOL_ASK,
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}],
         tools=[WEATHER], temperature=0, max_tokens=24),
]


@pytest.mark.parametrize("kw", TOOL_CASES, ids=[f"tools-{i}" for i in range(len(TOOL_CASES))])
def test_tool_calls_parsed_as_vllm_parses_them(clients, kw):
    want = _same(clients, "chat", **kw)
    if kw.get("tool_choice") not in (None, "none", "auto"):
        assert want.choices[0].message.tool_calls, "the case should produce a tool call"


def test_streamed_tool_call_deltas(clients):
    _, _, tools = _streamed(clients, "chat", **TOOL_CASES[0])
    assert tools and next(iter(tools.values()))[0] == "get_weather"


# ---- 5. structured outputs ---------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
STRUCTURED_CASES = [
    ("chat", dict(messages=[{"role": "user", "content": "Give me a JSON object about a cat."}], temperature=0,
                  max_tokens=40, response_format={"type": "json_object"})),
    ("chat", dict(messages=[{"role": "user", "content": "Describe a person."}], temperature=0, max_tokens=40,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})),
    ("chat", dict(messages=CHAT, temperature=0, max_tokens=8,
                  extra_body={"structured_outputs": {"choice": ["Paris", "London", "Rome"]}})),
    ("completion", dict(prompt="My phone number is", temperature=0, max_tokens=16,
                        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})),
    ("completion", dict(prompt="The answer is", temperature=0, max_tokens=8,
                        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})),
    ("completion", dict(prompt="A person:", temperature=0, max_tokens=40, extra_body={"structured_outputs": {"json": SCHEMA}})),
]


@pytest.mark.parametrize("kind,kw", STRUCTURED_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(STRUCTURED_CASES)])
def test_structured_outputs_enforced_by_the_generating_engine(clients, kind, kw):
    want = _same(clients, kind, **kw)
    text = want.choices[0].message.content if kind == "chat" else want.choices[0].text
    if "response_format" in kw and want.choices[0].finish_reason == "stop":
        json.loads(text)


# ---- 7. endpoints ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"model": MODEL, "prompt": "Hello there"}),
    ("/tokenize", {"model": MODEL, "messages": CHAT, "add_generation_prompt": True}),
    ("/detokenize", {"model": MODEL, "tokens": [19556, 665]}),
])
def test_tokenize_and_detokenize(fleet, reference, path, body):
    want = httpx.post(reference + path, json=body, timeout=30)
    got = httpx.post(fleet.url + path, json=body, timeout=30)
    assert got.status_code == want.status_code == 200 and got.json() == want.json()


def _post(url: str, path: str, body: dict, route: str | None = None) -> httpx.Response:
    headers = {"x-skyline-route": route, "x-slo-tier": "batch"} if route else None
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def _texts(resp: httpx.Response) -> list:
    return [(c["index"], (c.get("message") or {}).get("content", c.get("text")), c["finish_reason"])
            for c in resp.json()["choices"]]


def test_batched_chat_answers_each_conversation_as_vllm_serve(fleet, reference):
    """POST /v1/chat/completions/batch: one choice per conversation, in order, with vLLM's usage."""
    body = {"model": MODEL, "messages": [CHAT, [{"role": "user", "content": "Name a primary color."}]],
            "temperature": 0, "max_tokens": 12}
    want = _post(reference, "/v1/chat/completions/batch", body)
    assert want.status_code == 200 and len(want.json()["choices"]) == 2
    for route in ROUTES:
        got = _post(fleet.url, "/v1/chat/completions/batch", body, route)
        assert got.status_code == 200, (route, got.text)
        assert _texts(got) == _texts(want) and got.json()["usage"] == want.json()["usage"], route
    # Refused as vLLM refuses it (one choice per conversation).
    bad = {**body, "n": 2}
    assert _post(fleet.url, "/v1/chat/completions/batch", bad).status_code == \
        _post(reference, "/v1/chat/completions/batch", bad).status_code == 400


@pytest.mark.parametrize("body", [
    {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8},
    {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 8},
    {"model": MODEL, "max_tokens": 8},  # no prompt: vLLM's completion route refuses it
], ids=["chat", "completion", "no-prompt"])
def test_invocations_serves_the_body_as_vllm_serve_does(fleet, reference, body):
    want = _post(reference, "/invocations", body)
    got = _post(fleet.url, "/invocations", body, "disagg")
    assert got.status_code == want.status_code, got.text
    if want.status_code == 200:
        assert got.json()["object"] == want.json()["object"] and _texts(got) == _texts(want)
    else:
        assert got.json()["error"]["message"] == want.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_beam_search_finds_vllms_beams(clients, kind):
    """vLLM's serving code runs beam search over the fleet (a request per beam and step), in both routes."""
    prompt = dict(messages=CHAT) if kind == "chat" else dict(prompt=PROMPT)
    want = _same(clients, kind, **prompt, n=2, max_tokens=5, temperature=0, extra_body={"use_beam_search": True})
    assert len(want.choices) == 2


def test_anthropic_messages_api_answers_as_vllm_serve(fleet, reference):
    """Anthropic's own client against vllm serve's Messages API: the same text, stop reason and usage,
    streamed and not, in both routes, and the same token count."""
    import anthropic

    kw = dict(model=MODEL, max_tokens=16, system="Answer briefly.", extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "What is the capital of France?"}])

    def client(url, route=None):
        headers = {"x-skyline-route": route, "x-slo-tier": "batch"} if route else None
        return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120, default_headers=headers)

    def answer(c):
        m = c.messages.create(**kw)
        with c.messages.stream(**kw) as s:
            streamed = "".join(s.text_stream)
        return [b.text for b in m.content], m.stop_reason, (m.usage.input_tokens, m.usage.output_tokens), streamed

    ref = client(reference)
    want = answer(ref)
    assert want[0] and want[0][0] == want[3]
    for route in ROUTES:
        assert answer(client(fleet.url, route)) == want, route
    count = dict(model=MODEL, messages=kw["messages"], system=kw["system"])
    assert client(fleet.url).messages.count_tokens(**count).input_tokens == ref.messages.count_tokens(**count).input_tokens


def test_generative_scoring_as_vllm_serve(fleet, reference):
    """POST /generative_scoring: each item's probability of the first label token next (one read per
    item, each its own fleet request), within the tier's tolerance of vllm serve's, in both routes."""
    body = {"model": MODEL, "query": "The capital of France is", "items": [" Paris.", " Lyon.", " a city"],
            "label_token_ids": [504, 30, 28]}

    def scores(r: httpx.Response) -> list:
        assert r.status_code == 200, r.text
        return [(d["index"], d["score"]) for d in r.json()["data"]]

    want = _post(reference, "/generative_scoring", body)
    for route in ROUTES:
        got = _post(fleet.url, "/generative_scoring", body, route)
        assert _close(scores(got), scores(want)) and got.json()["usage"] == want.json()["usage"], route
    bad = {**body, "label_token_ids": [10**9]}  # out of the vocabulary: vLLM's 400
    assert _post(fleet.url, "/generative_scoring", bad).status_code == _post(reference, "/generative_scoring",
                                                                              bad).status_code == 400


@pytest.mark.parametrize("body", [
    {"model": MODEL, "state": "The sky is blue.",
     "questions": {"q1": {"type": "choice", "criteria": ["yes", "no"], "instructions": "Is the sky blue?"}}},
    {"model": MODEL},  # no state, no questions: vLLM's 400
], ids=["default-model", "invalid"])
def test_structured_decisions_answer_as_vllm_serve(fleet, reference, body):
    """POST /v1/systemone: vLLM serves structured decisions for the architectures it has a read strategy for
    (Qwen3 and a few others), and answers any other model, as the default one, with its 501."""
    want = _post(reference, "/v1/systemone", body)
    got = _post(fleet.url, "/v1/systemone", body)
    assert got.status_code == want.status_code and got.json()["error"]["message"] == want.json()["error"]["message"]


def test_responses_api_stateless(clients):
    ref, sky = clients
    kw = dict(model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=16, store=False)
    want = ref.responses.create(**kw)
    got = sky.responses.create(**kw)
    assert got.output_text == want.output_text and got.status == want.status


def test_responses_api_streams_vllms_events(clients):
    """The same events in the same order as `vllm serve` (runs of text deltas collapsed: the fleet's
    frames may carry several tokens each) and the same text."""
    ref, sky = clients
    kw = dict(model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=16, store=False,
              stream=True)

    def run(client) -> tuple[list[str], str]:
        types: list[str] = []
        text = ""
        for event in client.responses.create(**kw):
            if not types or types[-1] != event.type:
                types.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        return types, text

    assert run(sky) == run(ref)


# ---- 8. errors ---------------------------------------------------------------------------------------

ERROR_CASES = [
    ("chat", dict(messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=50)),
    ("completion", dict(prompt=PROMPT, max_tokens=8, temperature=-1)),
    ("chat", dict(messages=CHAT, max_tokens=8, n=0)),
    ("chat", dict(messages=CHAT, max_tokens=8, extra_body={"structured_outputs": {"regex": "("}})),
    ("chat", dict(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "missing"}}, max_tokens=8)),
]


@pytest.mark.parametrize("kind,kw", ERROR_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(ERROR_CASES)])
def test_errors_have_vllms_status(clients, kind, kw):
    ref, sky = clients
    with pytest.raises(openai.APIStatusError) as want:
        _call(ref, kind, None, **kw)
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as got:
            r = _call(sky, kind, "disagg", stream=stream, **kw)
            if stream:
                list(r)
        assert got.value.status_code == want.value.status_code, (stream, got.value, want.value)


def test_unknown_model_is_refused_as_vllm_refuses_it(clients):
    ref, sky = clients
    statuses = []
    for client in (ref, sky):
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="not-served", messages=CHAT, max_tokens=4)
        statuses.append(err.value.status_code)
    assert statuses[0] == statuses[1] == 404


# ---- 8. the clients people use: LangChain ------------------------------------------------------------


def _langchain(base_url: str, route: str | None, max_tokens: int):
    """LangChain's ChatOpenAI as its users point it at `vllm serve` (chat completions)."""
    from langchain_openai import ChatOpenAI

    headers = {"x-skyline-route": route, "x-slo-tier": "batch"} if route else None
    return ChatOpenAI(base_url=f"{base_url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=max_tokens,
                      max_retries=0, timeout=120, default_headers=headers)


def _langchain_same(fleet, reference, run, max_tokens: int):
    """`run(chat model)` against the reference and against Skyline on both routes: the same result."""
    want = run(_langchain(reference, None, max_tokens))
    for route in ROUTES:
        got = run(_langchain(fleet.url, route, max_tokens))
        assert got == want, (route, got, want)
    return want


def test_langchain_text_streaming_and_multi_turn_as_vllm_serve(fleet, reference):
    from langchain_core.messages import AIMessage, HumanMessage

    turns = [HumanMessage("What is the capital of France?"), AIMessage("Paris."), HumanMessage("And of Italy?")]
    want = _langchain_same(fleet, reference, lambda llm: (
        llm.invoke(turns).content, "".join(chunk.content for chunk in llm.stream("Name three colors."))), 16)
    assert all(want)


def test_langchain_tools_with_results_as_vllm_serve(fleet, reference):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city"""
        return "18 C and sunny"

    # The call is given, not generated: with a named tool_choice this 135M model writes arguments that are
    # not an object ('Paris'), which LangChain refuses before comparing anything. What is compared is how a
    # tool's result, in LangChain's messages, is rendered and answered.
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_0"}
    history = [HumanMessage("What is the weather in Paris?"), AIMessage("", tool_calls=[call]),
               ToolMessage(get_weather.invoke(call["args"]), tool_call_id="call_0")]
    def run(llm):
        reply = llm.bind_tools([get_weather]).invoke(history)
        return reply.content, [(c["name"], c["args"]) for c in reply.tool_calls]

    content, calls = _langchain_same(fleet, reference, run, 48)
    assert content or calls


def test_langchain_structured_output_as_vllm_serve(fleet, reference):
    schema = {"title": "person", "description": "A person", **SCHEMA}
    want = _langchain_same(fleet, reference, lambda llm: llm.with_structured_output(schema, method="json_schema")
                           .invoke("Describe a person."), 40)
    assert isinstance(want, dict)


# ---- 9. the clients people use: the OpenAI Agents SDK, LiteLLM, lm-evaluation-harness ------------------


def _route_headers(route: str | None) -> dict[str, str] | None:
    return {"x-skyline-route": route, "x-slo-tier": "batch"} if route else None


def test_openai_sdk_parse_gives_vllm_serves_object(clients):
    """The OpenAI SDK's `parse` (a pydantic model as the response format) over chat completions and the
    Responses API: the same parsed object."""
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        capital: str

    def run(client, route):
        headers = _route_headers(route)
        chat = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Capital, temperature=0,
                                             max_tokens=48, extra_headers=headers)
        resp = client.responses.parse(model=MODEL, input=CHAT[0]["content"], text_format=Capital, temperature=0,
                                      max_output_tokens=48, store=False, extra_headers=headers)
        return chat.choices[0].message.parsed, resp.output_parsed

    ref, sky = clients
    want = run(ref, None)
    assert all(isinstance(p, Capital) for p in want), want
    for route in ROUTES:
        assert run(sky, route) == want, route


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_runs_a_function_tool_as_against_vllm_serve(fleet, reference, api):
    """An Agents SDK agent with a function tool, over chat completions and over the Responses API (the
    SDK's default model, whose `store` Skyline keeps in Redis): the same tool call and the same result."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's servers
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    def run(url: str, route: str | None):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120,
                                    default_headers=_route_headers(route))
        model_cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                      model=model_cls(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required"),
                      tool_use_behavior="stop_on_first_tool")
        calls.clear()
        result = Runner.run_sync(agent, "What is the weather in Paris?")
        return list(calls), result.final_output

    want = run(reference, None)
    assert want[0], want  # the tool ran
    for route in ROUTES:
        assert run(fleet.url, route) == want, route


def test_litellm_openai_compatible_provider_as_against_vllm_serve(fleet, reference, monkeypatch):
    """LiteLLM's provider for vLLM servers: chat, streamed chat, a tool call and a JSON schema answer."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the network at import
    import litellm

    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}

    def run(url: str, route: str | None):
        kw = dict(model=f"hosted_vllm/{MODEL}", api_base=f"{url}/v1", api_key="unused", temperature=0,
                  max_tokens=24, extra_headers=_route_headers(route), num_retries=0)
        text = litellm.completion(messages=CHAT, **kw).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=CHAT, stream=True, **kw))
        call = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                  tools=[WEATHER], tool_choice="required", **{**kw, "max_tokens": 64}
                                  ).choices[0].message.tool_calls[0]
        answer = litellm.completion(messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}, **kw)
        return text, streamed, (call.function.name, json.loads(call.function.arguments)), \
            json.loads(answer.choices[0].message.content)

    want = run(reference, None)
    assert want[0] and want[0] == want[1]
    for route in ROUTES:
        assert run(fleet.url, route) == want, route


LM_EVAL_TASKS = """\
task: skyline_capitals_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "Q: What is the capital of {{{{country}}}}?\\nA:"
doc_to_target: "{target}"
{extra}
"""


def test_lm_evaluation_harness_scores_as_against_vllm_serve(fleet, reference, tmp_path):
    """lm-evaluation-harness's local-completions model (log-likelihoods through echo + logprobs, and
    generation) on a task made here: the same per-sample log-likelihoods (within the tolerance engines
    that batch differently allow), the same generations and scores."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from skyline.tools.model import resolve_model

    rows = [("France", "Paris", ["Paris", "Lyon"]), ("Italy", "Rome", ["Milan", "Rome"]),
            ("Japan", "Tokyo", ["Tokyo", "Osaka"]), ("Spain", "Madrid", ["Seville", "Madrid"])]
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"country": c, "capital": a, "choices": ch, "label": ch.index(a)}) + "\n"
                            for c, a, ch in rows))
    (tmp_path / "mc.yaml").write_text(LM_EVAL_TASKS.format(
        kind="mc", data=data, output_type="multiple_choice", target="{{label}}",
        extra='doc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc'))
    (tmp_path / "gen.yaml").write_text(LM_EVAL_TASKS.format(
        kind="gen", data=data, output_type="generate_until", target=" {{capital}}",
        extra="generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 8\n  do_sample: false\n"
              "metric_list:\n  - metric: exact_match"))
    tasks = TaskManager(include_path=str(tmp_path))

    def run(url: str, route: str | None):
        args = {"model": MODEL, "base_url": f"{url}/v1/completions", "num_concurrent": 1, "max_retries": 1,
                "tokenizer_backend": "huggingface", "tokenizer": resolve_model("default")}
        if route:
            args["header"] = _route_headers(route)
        out = lm_eval.simple_evaluate(model="local-completions", model_args=args, task_manager=tasks,
                                      tasks=["skyline_capitals_mc", "skyline_capitals_gen"], log_samples=True)
        mc = [[r[0][0] for r in s["resps"]] for s in out["samples"]["skyline_capitals_mc"]]
        gen = [s["resps"][0][0] for s in out["samples"]["skyline_capitals_gen"]]
        return out["results"]["skyline_capitals_mc"]["acc,none"], mc, gen

    want = run(reference, None)
    for route in ROUTES:
        acc, mc, gen = run(fleet.url, route)
        assert acc == want[0] and gen == want[2] and _close(mc, want[1]), (route, acc, mc, gen, want)
