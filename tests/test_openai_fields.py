"""Every field of vLLM's chat and completion request models either takes effect or is refused.

Skyline runs vLLM's serving code, so a field is handled by vLLM's code in the
gateway (rendering, response shape), or ends up in the `SamplingParams` that
travel whole to the generating engine, or is refused by Skyline with a 400 that
names it. The table below classifies every field of vLLM's models; a field a
vLLM upgrade adds fails `test_every_field_is_classified` until someone decides
which it is. Sampling fields are checked to really change the `SamplingParams`
(so they reach the engine), and refused ones to be refused by a real gateway.
"""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from skyline.core.config import load_config
from skyline.gateway.testing import GatewayThread, announce_workers

MODEL = "skyline-sim"

# Reaches the engine inside SamplingParams: a non-default value to show it changes them.
SAMPLING = {
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "frequency_penalty": 0.5, "ignore_eos": True,
    "include_stop_str_in_output": True, "logit_bias": {"5": 1.0}, "logprob_token_ids": [3],
    "max_tokens": 7, "min_p": 0.1, "min_tokens": 2, "n": 2, "presence_penalty": 0.5, "prompt_logprobs": 1,
    "repetition_penalty": 1.2, "seed": 3, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "stop": ["z"], "stop_token_ids": [9], "temperature": 0.3, "top_k": 4, "top_p": 0.5, "logprobs": 2,
    "vllm_xargs": {"k": 1}, "structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"},
    "truncate_prompt_tokens": 3, "watermarking": True, "stream_interval": 2,
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
    "max_completion_tokens": 6, "top_logprobs": 2,
}
# Handled by vLLM's serving code in the gateway (rendering, parsing, the response's shape).
SERVING = {
    "model", "messages", "prompt", "stream", "stream_options", "echo", "user", "request_id", "tools", "tool_choice",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "include_reasoning", "reasoning_effort", "return_token_ids",
    "return_prompt_text", "return_tokens_as_token_ids", "return_token_offsets", "truncation_side", "suffix",
    "length_penalty", "use_beam_search",  # vLLM's serving code runs beam search, one fleet request per beam and step
}
# Carried with the prompt to the generating engine (its TokensPrompt): test_gateway_flow.py checks that it
# reaches the queued request, test_vllm_parity.py that the answer is vLLM's.
PROMPT = {"cache_salt"}
# Refused by Skyline (400 naming the field): a value that would otherwise be accepted.
REFUSED = {
    "priority": 1, "kv_transfer_params": {"do_remote_prefill": True}, "session_id": "s",
    "thinking_token_budget": 8, "ec_transfer_params": {"x": 1},
    "routed_experts_prompt_start": 1,
}
# Multimodal inputs and their options: refused (Skyline serves text; the sim's and the default model's
# renderers have no multimodal processor, which refuses them as vLLM does for a text model).
MULTIMODAL = {"mm_processor_kwargs", "media_io_kwargs", "mm_payload", "return_mm_kwargs", "prompt_embeds"}


def _models():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return ChatCompletionRequest, CompletionRequest


def test_every_field_is_classified():
    for model in _models():
        unknown = set(model.model_fields) - set(SAMPLING) - SERVING - PROMPT - set(REFUSED) - MULTIMODAL
        assert not unknown, f"{model.__name__} has fields Skyline has not classified: {sorted(unknown)}"


@pytest.mark.parametrize("field", sorted(SAMPLING))
def test_sampling_fields_change_the_sampling_params_the_engine_gets(field):
    chat, completion = _models()
    for model, base in ((chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                        (completion, {"model": MODEL, "prompt": "hi"})):
        if field not in model.model_fields:
            continue
        if model is chat and field in ("logprobs", "top_logprobs", "logprob_token_ids"):
            base = {**base, "logprobs": field != "logprobs"}  # chat: a bool, the others need it on
            value = True if field == "logprobs" else SAMPLING[field]
        elif field == "logprob_token_ids":
            base, value = {**base, "logprobs": 1}, SAMPLING[field]
        else:
            value = SAMPLING[field]
        default = model.model_validate(base).to_sampling_params(16, {})
        changed = model.model_validate({**base, field: value}).to_sampling_params(16, {})
        if field in ("max_tokens", "max_completion_tokens", "truncate_prompt_tokens"):
            continue  # read by vLLM's serving code before to_sampling_params (the max_tokens it passes)
        assert changed != default, f"{model.__name__}.{field} does not change SamplingParams"


@pytest.fixture(scope="module")
def gateway(redis_url):
    cfg = load_config(None)
    prefix = "fields-test"
    cfg = replace(cfg, key_prefix=prefix, redis=replace(cfg.redis, url=redis_url))
    announce_workers(redis_url, __import__("skyline.core.keys", fromlist=["Keys"]).Keys(prefix), "prefill", "decode")
    with GatewayThread(cfg, None, MODEL, 256) as gw:
        yield gw


@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_refused_fields_get_a_400_that_names_them(gateway, path, field):
    body = {"model": MODEL, "max_tokens": 4, field: REFUSED[field]}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(gateway.url + path, json=body, timeout=30)
    assert r.status_code == 400, (field, r.status_code, r.text)
    assert field.split("_")[0] in r.json()["error"]["message"].lower() or field in str(r.json()["error"]["param"])
