"""vLLM's serving-layer arguments (`vllm serve`'s frontend options: usage details, token ids, chat-template
defaults, tool-choice handling, ..., and its HTTP server's), parsed by vLLM's own parser and handed to the
gateway's vLLM serving objects as `vllm serve` hands them (gateway/vllm_serving_internals.py
`serving_objects`); the server's go to the gateway's uvicorn (`SERVER`, gateway/server.py).

`skyline up` takes them among its vLLM arguments: `split` keeps the ones vLLM's frontend parser knows for the
gateway and leaves the rest to the engines' parser (skyline/core/engine_args.py). `skyline gateway` takes them
after its own options. A few are refused with the reason: what belongs to a part of `vllm serve` Skyline's
gateway does not run (below, `REFUSED`).
"""

from __future__ import annotations

import argparse
from typing import Any

# The options of vLLM's FrontendArgs Skyline takes elsewhere: its own flags of the same name (chat template,
# tool choice and parser, host, port, API keys, handled by `skyline gateway`/`up` themselves) and
# `--lora-modules`, which the workers register in the fleet's adapter registry (skyline/core/engine_args.py).
OWN = frozenset({"chat_template", "enable_auto_tool_choice", "tool_call_parser", "lora_modules", "host", "port",
                 "api_key"})

# vllm serve's HTTP-server options the gateway applies (gateway/server.py, and its middleware:
# vllm_serving_internals.add_server_middleware); accepted as what the gateway does anyway: no access log, no /docs.
SERVER = frozenset({"root_path", "uvicorn_log_level", "disable_uvicorn_access_log", "disable_access_log_for_endpoints",
                    "disable_fastapi_docs", "allowed_origins", "allow_credentials", "allowed_methods",
                    "allowed_headers", "enable_request_id_headers", "middleware"})
_PROXY = "terminate it in a proxy in front of the gateway (docs/operations.md)"

# Given, these are refused with the reason, not accepted and ignored.
REFUSED = {
    "tool_server": "the gateway runs no MCP/built-in tool server for the Responses API",
    "enable_scale_out": "vLLM's scale-out routes are not served (docs/api.md, 501 not_served)",
    "tokens_only": "the gateway always renders and detokenizes (vLLM's tokens-only server mode is not served)",
    "enable_tokenizer_info_endpoint": "/tokenizer_info is not served",
    "sse_keep_alive_interval": "the gateway's streams send no keep-alive comments",
    "enable_server_load_tracking": "the gateway's /load reports the fleet's load from Redis (docs/operations.md)",
    "tool_parser_plugin": "a tool parser plugin file is not loaded by the gateway; install it as a package "
                          "registering the parser (vLLM's plugin entry point) instead",
    "trust_request_mm_kwargs": "multimodal requests are not served",
    "cohere_is_reasoning_model": "the Cohere API is not served",
    "cohere_format": "the Cohere API is not served",
    # vllm serve's HTTP server, where the gateway's differs:
    "uds": "the gateway listens on TCP (--host, --port)",
    "ssl_keyfile": f"the gateway serves plain HTTP: {_PROXY}", "ssl_certfile": f"the gateway serves plain HTTP: {_PROXY}",
    "ssl_ca_certs": f"the gateway serves plain HTTP: {_PROXY}", "ssl_cert_reqs": f"the gateway serves plain HTTP: {_PROXY}",
    "ssl_ciphers": f"the gateway serves plain HTTP: {_PROXY}", "enable_ssl_refresh": f"the gateway serves plain HTTP: {_PROXY}",
    "h11_max_incomplete_event_size": "the gateway's HTTP parser is httptools; its bound is [gateway] max_header_bytes",
    "h11_max_header_count": "the gateway's HTTP parser is httptools; its bound is [gateway] max_header_bytes",
    "enable_offline_docs": "the gateway serves no /docs",
    "grpc_port": "the gateway serves no gRPC",
    "data_parallel_supervisor_port": "the fleet is scaled by worker processes, not vLLM's data-parallel supervisor",
    "dp_supervisor_probe_interval_s": "the fleet is scaled by worker processes, not vLLM's data-parallel supervisor",
    "dp_supervisor_probe_timeout_s": "the fleet is scaled by worker processes, not vLLM's data-parallel supervisor",
    "dp_supervisor_probe_failure_threshold": "the fleet is scaled by worker processes, not vLLM's data-parallel supervisor",
    "enable_flash_late_interaction": "pooling models are not served",
}

_PARSER: Any = None
_DEFAULTS: dict[str, Any] = {}


class FrontendArgsError(ValueError):
    """A frontend argument vLLM's parser or Skyline refused; the message says which and why."""


def parser() -> Any:
    """vLLM's parser of FrontendArgs (vllm serve's serving-layer and HTTP-server options), every default
    suppressed, so that a parse holds what was given and nothing else."""
    global _PARSER
    if _PARSER is None:
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        class Parser(FlexibleArgumentParser):
            def error(self, message: str):  # type: ignore[override]
                raise FrontendArgsError(message)

        p = Parser(prog="vLLM frontend arguments", add_help=False)
        FrontendArgs.add_cli_args(p)
        for action in p._actions:
            if action.default is not argparse.SUPPRESS:
                _DEFAULTS[action.dest] = action.default
            action.default = argparse.SUPPRESS
        _PARSER = p
    return _PARSER


def _takes_value(action: Any) -> bool:
    return action.nargs != 0


def split(argv: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(frontend arguments, the rest) of a `vllm serve`-style argument list, in order: an option vLLM's
    frontend parser knows (and Skyline does not take under its own flags, `OWN`) goes left with its value."""
    p = parser()
    frontend: list[str] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        word = args[i]
        name = word.split("=", 1)[0]
        action = p._option_string_actions.get(name) if word.startswith("--") else None
        if action is None or action.dest in OWN:
            rest.append(word)
            i += 1
            continue
        frontend.append(word)
        i += 1
        if "=" not in word and _takes_value(action):
            # A value, or several (nargs "+"/"*"), up to the next option.
            while i < len(args) and not args[i].startswith("-"):
                frontend.append(args[i])
                i += 1
                if action.nargs in (None, "?"):
                    break
    return frontend, rest


def parse(argv: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """{dest: value} of the frontend arguments given, checked by vLLM's parser and Skyline's refusals."""
    try:
        given = vars(parser().parse_args(list(argv)))
    except (ValueError, TypeError) as exc:
        raise FrontendArgsError(str(exc)) from exc
    refused = [f"--{dest.replace('_', '-')}: {why}" for dest, why in REFUSED.items() if dest in given]
    if refused:
        raise FrontendArgsError("not taken by Skyline's gateway: " + "; ".join(refused))
    return given


def namespace(argv: list[str] | tuple[str, ...], **own: Any) -> argparse.Namespace:
    """vLLM's frontend defaults, then `own` (Skyline's options of vLLM's names), then `argv`'s values: the
    options `vllm serve` would build its serving objects from."""
    parser()
    return argparse.Namespace(**{**_DEFAULTS, **own, **parse(argv)})
