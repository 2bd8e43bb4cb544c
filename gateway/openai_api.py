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
gateway loads no engine (vLLM's GPU-less render server builds the same way).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyline.core.config import SkylineConfig

log = logging.getLogger("skyline.gateway")


@dataclass
class Frontend:
    """vLLM's serving objects for one served model, over one FleetClient."""

    models: Any  # OpenAIServingModels
    chat: Any  # OpenAIServingChat
    completion: Any  # OpenAIServingCompletion
    responses: Any  # OpenAIServingResponses
    tokenization: Any  # ServingTokenization


def vllm_config(model_path: str, max_model_len: int, reasoning_parser: str = "") -> Any:
    """The VllmConfig of a server that renders and parses but never runs the model."""
    import vllm.envs as envs
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig

    args = AsyncEngineArgs(model=model_path, max_model_len=max_model_len, reasoning_parser=reasoning_parser or None,
                           skip_tokenizer_init=False)
    model_config = args.create_model_config()
    model_config.quantization = None  # no kernels run here (as vLLM's render server does)
    envs.VLLM_CPU_KVCACHE_SPACE = 0  # no KV cache here either; silences vLLM's CPU warning
    return VllmConfig(model_config=model_config, structured_outputs_config=args.create_structured_outputs_config())


def chat_template_text(spec: str) -> str | None:
    """`chat_template` as vllm serve's --chat-template takes it: a file, or the template itself."""
    if not spec:
        return None
    from vllm.renderers.chat_utils import load_chat_template

    if Path(spec).expanduser().is_file():
        return load_chat_template(str(Path(spec).expanduser()))
    return load_chat_template(spec)


def build_frontend(cfg: SkylineConfig, client_cls: type, dispatcher: Any, model_path: str, served_model: str,
                   max_model_len: int) -> Frontend:
    """vLLM's serving objects as `vllm serve --model model_path --served-model-name served_model
    --max-model-len max_model_len` plus the gateway's tool/reasoning/chat-template options."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.v1.engine.input_processor import InputProcessor

    g = cfg.gateway
    if g.enable_auto_tool_choice and not g.tool_call_parser:
        raise ValueError("gateway.enable_auto_tool_choice needs gateway.tool_call_parser (as vllm serve's "
                         "--enable-auto-tool-choice needs --tool-call-parser)")
    config = vllm_config(model_path, max_model_len, g.reasoning_parser)
    renderer = renderer_from_config(config)
    client = client_cls(config, renderer, InputProcessor(config, renderer), dispatcher)
    template = chat_template_text(g.chat_template)
    tool_parser = g.tool_call_parser or None
    reasoning = g.reasoning_parser or ""
    models = OpenAIServingModels(engine_client=client,
                                 base_model_paths=[BaseModelPath(name=served_model, model_path=model_path)])
    online = OnlineRenderer(
        model_config=config.model_config, renderer=renderer, request_logger=None, chat_template=template,
        chat_template_content_format="auto", enable_auto_tools=g.enable_auto_tool_choice, tool_parser=tool_parser,
        reasoning_parser=reasoning or None,
    )
    online.warmup()
    chat = OpenAIServingChat(
        client, models, g.response_role, online_renderer=online, request_logger=None, chat_template=template,
        chat_template_content_format="auto", reasoning_parser=reasoning, enable_auto_tools=g.enable_auto_tool_choice,
        tool_parser=tool_parser,
    )
    completion = OpenAIServingCompletion(client, models, online_renderer=online, request_logger=None)
    responses = OpenAIServingResponses(
        client, models, online, request_logger=None, chat_template=template, chat_template_content_format="auto",
        reasoning_parser=reasoning, enable_auto_tools=g.enable_auto_tool_choice, tool_parser=tool_parser,
    )
    tokenization = ServingTokenization(models, online, request_logger=None, chat_template=template,
                                       chat_template_content_format="auto")
    log.info("OpenAI surface: vLLM's serving layer (tool parser %s, auto tool choice %s, reasoning parser %s)",
             tool_parser or "none", g.enable_auto_tool_choice, reasoning or "none")
    return Frontend(models, chat, completion, responses, tokenization)
