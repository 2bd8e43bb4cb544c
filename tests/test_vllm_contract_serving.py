"""The serving side's contract with vLLM: every internal gateway/vllm_serving_internals.py relies on
(vLLM's serving classes, request models, renderer, input checks, error responses and handlers, the
bench's server and client) is there in the installed vLLM with the parameters and fields used. A
vLLM upgrade that moved one fails here, naming it (docs/vllm-versions.md). The engine side's:
tests/test_vllm_contract_engine.py."""

from __future__ import annotations

import pytest

from skyline.core.vllm_contract import Internal
from skyline.gateway import vllm_serving_internals as serving


@pytest.mark.parametrize("internal", serving.CONTRACT, ids=lambda i: i.qualname)
def test_the_serving_side_internal_is_there(internal: Internal):
    internal.check()


def test_errors_are_told_apart_by_where_vllm_raised_them():
    """The gateway answers a bare ValueError with its text only when vLLM's code raised it (gateway/errors.py)."""
    from vllm import SamplingParams

    with pytest.raises(Exception) as of_vllms_type:
        SamplingParams(top_p=5)
    assert serving.is_vllm_type(of_vllms_type.value)
    # vLLM's code is told by its modules' names: a bare ValueError raised in one of them is vLLM's.
    assert all(i.resolve().__module__.split(".")[0] == serving.VLLM_PACKAGE
               for i in (serving.SERVING_CHAT, serving.RENDERER_FROM_CONFIG, serving.PROCESS_INPUTS))
    in_vllm: dict = {"__name__": "vllm.renderers.some_module"}
    exec("def refuse():\n    raise ValueError('roles must alternate')", in_vllm)  # noqa: S102
    with pytest.raises(ValueError) as raised_by_vllm:
        in_vllm["refuse"]()
    assert not serving.is_vllm_type(raised_by_vllm.value) and serving.raised_in_vllm(raised_by_vllm.value)
    with pytest.raises(ValueError) as raised_here:
        int("x")
    assert not serving.raised_in_vllm(raised_here.value)
    err = serving.validation_error("bad", parameter="p", value=1)
    info = serving.error_info(err)
    assert serving.is_vllm_type(err) and (info.code, info.type, info.param) == (400, "BadRequestError", "p")


def test_the_fleet_client_is_an_engine_client_of_vllms():
    from skyline.gateway.fleet_client import fleet_client_class

    cls = fleet_client_class()
    assert issubclass(cls, serving.ENGINE_CLIENT.resolve()) and not cls.__abstractmethods__


def test_the_bench_client_script_names_vllms_functions():
    compile(serving.BENCH_SERVE_SCRIPT, "<vllm bench serve>", "exec")
    for internal in (serving.ARGUMENT_PARSER, serving.BENCH_SERVE_ADD_ARGS, serving.BENCH_SERVE_MAIN):
        assert internal.name in serving.BENCH_SERVE_SCRIPT and internal.module in serving.BENCH_SERVE_SCRIPT


def test_every_serving_layer_option_reaches_a_serving_class():
    """Each option vllm serve's arguments set (`serving_options`) is a parameter of at least one of the serving
    classes the gateway builds: an option vLLM renamed would otherwise be dropped without a word (each class
    gets only the options its constructor takes)."""
    import inspect

    from skyline.core import frontend_args

    classes = [i.resolve() for i in (serving.ONLINE_RENDERER, serving.SERVING_CHAT, serving.SERVING_CHAT_BATCH,
                                     serving.SERVING_MESSAGES, serving.SERVING_COMPLETION, serving.SERVING_RESPONSES,
                                     serving.SERVING_TOKENIZATION)]
    taken = {name for cls in classes for name in inspect.signature(cls).parameters}
    options = serving.serving_options(frontend_args.namespace([]))
    assert set(options) <= taken, sorted(set(options) - taken)
