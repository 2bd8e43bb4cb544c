"""vllm serve's serving-layer arguments (skyline/core/frontend_args.py): split from the engine arguments,
checked by vLLM's parser, refused with the reason where Skyline's gateway does not run that part."""

from __future__ import annotations

import subprocess
import sys

import pytest

from skyline.core import frontend_args


def test_split_sends_serving_layer_flags_to_the_gateway_and_the_rest_to_the_engines():
    argv = ["--dtype", "float32", "--enable-prompt-tokens-details", "--max-num-seqs", "8",
            "--default-chat-template-kwargs", '{"enable_thinking": false}', "--seed", "0",
            "--lora-modules", "a=/x", "--response-role=bot", "--return-tokens-as-token-ids"]
    frontend, engine = frontend_args.split(argv)
    assert frontend == ["--enable-prompt-tokens-details", "--default-chat-template-kwargs",
                        '{"enable_thinking": false}', "--response-role=bot", "--return-tokens-as-token-ids"]
    # --lora-modules is vLLM's frontend option, but the workers register the adapters (engine_args).
    assert engine == ["--dtype", "float32", "--max-num-seqs", "8", "--seed", "0", "--lora-modules", "a=/x"]


def test_namespace_has_vllms_defaults_under_what_was_given():
    ns = frontend_args.namespace(["--enable-prompt-tokens-details", "--response-role", "bot"],
                                 response_role="assistant", tool_call_parser=None)
    assert ns.enable_prompt_tokens_details is True and ns.response_role == "bot"  # the flag over Skyline's key
    assert ns.return_tokens_as_token_ids is False and ns.chat_template_content_format == "auto"  # vLLM's defaults
    assert frontend_args.namespace([], response_role="me").response_role == "me"


@pytest.mark.parametrize("argv, says", [
    (["--tool-server", "demo"], "--tool-server: the gateway runs no MCP"),
    (["--enable-scale-out"], "--enable-scale-out: vLLM's scale-out routes are not served"),
    (["--chat-template-content-format", "yaml"], "invalid choice: 'yaml'"),
])
def test_refused_or_invalid_arguments_say_why(argv, says):
    with pytest.raises(frontend_args.FrontendArgsError) as ei:
        frontend_args.parse(argv)
    assert says in str(ei.value)


def test_the_gateway_command_checks_its_vllm_arguments_before_starting():
    """`skyline gateway` takes both kinds (it checks requests as the engines would, so it gets their
    arguments too); a refused or malformed one ends it with exit 2 and the reason, before it starts."""
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "skyline.cli", "gateway", "--engine", "sim", *argv],
                              capture_output=True, text=True, timeout=120)

    got = run("--tool-server", "demo")
    assert got.returncode == 2 and "--tool-server: the gateway runs no MCP" in got.stderr
    got = run("--max-logprobs", "many")
    assert got.returncode == 2 and "invalid int value: 'many'" in got.stderr


def test_vllm_api_key_is_required_as_vllm_serve_requires_it(monkeypatch):
    """vllm serve's VLLM_API_KEY: the gateway requires it where no Skyline flag or variable names keys."""
    from skyline.cli import build_parser, config_from_args

    monkeypatch.delenv("SKYLINE_API_KEYS", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert config_from_args(build_parser().parse_args(["gateway"])).gateway.api_keys == ("from-vllm",)
    given = build_parser().parse_args(["gateway", "--api-key", "mine"])
    assert config_from_args(given).gateway.api_keys == ("mine",)  # --api-key first, as in vllm serve


def test_server_options_reach_the_gateways_http_server():
    """--root-path (behind a path-routing proxy) and --uvicorn-log-level are vllm serve's HTTP-server options
    the gateway applies (gateway/server.py); TLS is refused, saying where it belongs."""
    frontend, engine = frontend_args.split(["--root-path", "/llm", "--uvicorn-log-level", "warning", "--dtype", "half"])
    assert engine == ["--dtype", "half"]
    assert frontend_args.parse(frontend) == {"root_path": "/llm", "uvicorn_log_level": "warning"}
    with pytest.raises(frontend_args.FrontendArgsError, match="in a proxy in front of the gateway"):
        frontend_args.parse(["--ssl-keyfile", "k.pem"])
