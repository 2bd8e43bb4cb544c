"""vLLM's own OpenAI serving layer, built over the Skyline fleet.

Skyline does not write a second OpenAI server. The gateway builds the objects
`vllm serve` builds (request models, chat-template rendering with tools, tool
and reasoning parsers, structured-output parameters, logprob formatting, `n`,
echo, the Responses API, tokenize/detokenize), configured the way `vllm serve`
is configured, and gives them a `FleetClient` where `vllm serve` gives them its
engine (vLLM's `EngineClient` interface: gateway/fleet_client.py). Everything a
client sees is vLLM's code; what happens between `generate()` and the outputs
(SLO tiers, admission, the Redis streams, P/D over NIXL, migration) is Skyline's.

Building these needs the model's config and tokenizer, never its weights: the
gateway loads no engine (vLLM's GPU-less render server builds the same way). The vLLM classes
are reached through gateway/vllm_serving_internals.py, which names every one Skyline relies on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from skyline.core import frontend_args
from skyline.core.config import SkylineConfig
from skyline.gateway import vllm_serving_internals
from skyline.gateway.errors import ApiError

log = logging.getLogger("skyline.gateway")


@dataclass
class Frontend:
    """vLLM's serving objects for one served model, over one FleetClient."""

    models: Any  # OpenAIServingModels
    chat: Any  # OpenAIServingChat
    chat_batch: Any  # OpenAIServingChatBatch (POST /v1/chat/completions/batch)
    messages: Any  # AnthropicServingMessages (POST /v1/messages)
    completion: Any  # OpenAIServingCompletion
    responses: Any  # OpenAIServingResponses
    scoring: Any  # ServingGenerativeScoring (POST /generative_scoring)
    decisions: Any  # ServingStructuredDecisions (POST /v1/systemone); None where vLLM has none for the model
    tokenization: Any  # ServingTokenization


def chat_template_text(spec: str) -> str | None:
    """`chat_template` as vllm serve's --chat-template takes it: a file, or the template itself."""
    if not spec:
        return None
    return vllm_serving_internals.load_chat_template(spec)


def build_frontend(cfg: SkylineConfig, client_cls: type, dispatcher: Any, model_path: str, served_model: str,
                   max_model_len: int, engine_args: dict[str, Any] | None = None) -> Frontend:
    """vLLM's serving objects as `vllm serve --model model_path --served-model-name served_model
    --max-model-len max_model_len` plus the gateway's vLLM serving-layer options and `engine_args` (the
    engines' vLLM arguments, {dest: value}: requests are checked against the config they make)."""
    g = cfg.gateway
    if g.enable_auto_tool_choice and not g.tool_call_parser:
        raise ValueError("gateway.enable_auto_tool_choice needs gateway.tool_call_parser (as vllm serve's "
                         "--enable-auto-tool-choice needs --tool-call-parser)")
    config = vllm_serving_internals.engine_config(model_path, max_model_len, g.reasoning_parser, engine_args or {})
    renderer, input_processor = vllm_serving_internals.renderer_and_input_processor(config)
    client = client_cls(config, renderer, input_processor, dispatcher)
    tool_parser = g.tool_call_parser or None
    reasoning = g.reasoning_parser or ""
    # vllm serve's serving-layer arguments: vLLM's defaults, the gateway's vLLM flags, then its own options
    # of vLLM's names (a config file's [gateway] keys, the command line's flags).
    args = frontend_args.namespace(g.vllm_args, chat_template=g.chat_template or None, response_role=g.response_role,
                                   enable_auto_tool_choice=g.enable_auto_tool_choice, tool_call_parser=tool_parser)
    objs = vllm_serving_internals.serving_objects(
        client, config, renderer, served_model=served_model, model_path=model_path,
        chat_template=chat_template_text(g.chat_template), args=args, reasoning_parser=reasoning)
    log.info("OpenAI surface: vLLM's serving layer (tool parser %s, auto tool choice %s, reasoning parser %s)",
             tool_parser or "none", g.enable_auto_tool_choice, reasoning or "none")
    messages = objs.messages
    if messages is None:
        log.warning("the Messages API (/v1/messages) is not served for %s: vLLM could not build it over its chat "
                    "template (%s)", served_model, objs.messages_error)
        messages = MessagesUnavailable(served_model, objs.messages_error)
    return Frontend(objs.models, objs.chat, objs.chat_batch, messages, objs.completion, objs.responses,
                    objs.scoring, objs.decisions, objs.tokenization)


class MessagesUnavailable:
    """In place of vLLM's Messages serving where it could not be built: each request is told why."""

    def __init__(self, model: str, why: str):
        self.message = (f"the Messages API is not served for model {model!r}: vLLM could not build it over the "
                        f"model's chat template ({why})")

    async def create_messages(self, request: Any, raw_request: Any) -> Any:
        raise ApiError(501, self.message, code="not_served")

    count_tokens = create_messages
