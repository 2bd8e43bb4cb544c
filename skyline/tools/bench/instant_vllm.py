"""`vllm serve` over an engine that takes no time: the baseline of `skyline bench overhead`.

The fleet's overhead is what Skyline adds to a request's TTFT, and part of
what the gateway does is vLLM's own serving code (HTTP routes, request models,
rendering, tokenization, stream formatting), which `vllm serve` runs too. To
tell the two apart in one run, this process serves vLLM's own OpenAI app
(`build_app` + `init_app_state`, the routes and middleware of `vllm serve`)
over an engine client whose `generate` runs vLLM's engine-side input checks
and then answers at once: one token per requested token, no model. Against
`sim` engines at zero latency, Skyline's TTFT minus this server's is what the
fleet adds (Redis, admission, the workers, the relay) over `vllm serve`.
What it leaves out favours vLLM: a real `vllm serve` also pays its engine-core
round trip (ZMQ to the engine process), which Skyline's workers pay too.

Run: `python -m skyline.tools.bench.instant_vllm --port P` (model: the sim model
folder, served as `skyline-sim`).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from skyline.gateway import vllm_serving_internals

SERVED_MODEL = "skyline-sim"
TOKEN = ord("x")  # the sim model's byte-level vocabulary: token id = byte


class InstantEngine:
    """The part of vLLM's EngineClient that its serving code calls, answered without a model."""

    def __init__(self, vllm_config: Any, renderer: Any, input_processor: Any):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = input_processor

    is_running = property(lambda self: True)
    is_stopped = property(lambda self: False)
    errored = property(lambda self: False)
    dead_error = property(lambda self: RuntimeError("the instant engine does not die"))

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **_: Any
                       ) -> AsyncGenerator[Any, None]:
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        # What AsyncLLM.add_request does before the engine core (the same check the FleetClient runs).
        vllm_serving_internals.check_inputs(self.input_processor, request_id, prompt, sampling_params)
        ids = list(prompt["prompt_token_ids"])
        total = max(1, int(sampling_params.max_tokens or 1))
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        for step in range(1, total + 1):
            if not delta and step < total and sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            done = step == total
            n_tokens = 1 if delta else step
            outs = [CompletionOutput(index=i, text="x" * n_tokens, token_ids=[TOKEN] * n_tokens,
                                     cumulative_logprob=None, logprobs=None,
                                     finish_reason="length" if done else None)
                    for i in range(sampling_params.n)]
            yield RequestOutput(request_id, prompt.get("prompt"), ids, None, outs, finished=done)
            await asyncio.sleep(0)

    async def abort(self, request_id: Any) -> None:
        return None

    def check_admission(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def check_health(self) -> None:
        return None


def _engine_class() -> type:
    """InstantEngine as a subclass of vLLM's EngineClient (its serving code checks the type)."""

    def unused(name: str):
        async def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"{name}: not an operation of the instant engine")
        return refuse

    return vllm_serving_internals.engine_client_class(InstantEngine, "InstantEngine", unused)


async def serve(port: int, max_model_len: int) -> None:
    import uvicorn

    from skyline.core.sim_model import sim_model_dir

    model = str(sim_model_dir())
    config = vllm_serving_internals.engine_config(model, max_model_len)
    engine = _engine_class()(config, *vllm_serving_internals.renderer_and_input_processor(config))
    app, init_state = vllm_serving_internals.api_server_app(
        ["--model", model, "--served-model-name", SERVED_MODEL, "--max-model-len", str(max_model_len),
         "--disable-log-stats", "--disable-uvicorn-access-log"], engine, config.model_config)
    await init_state()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    await server.serve()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=4096)
    a = p.parse_args()
    asyncio.run(serve(a.port, a.max_model_len))


if __name__ == "__main__":
    main()
