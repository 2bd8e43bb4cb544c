"""A plain vLLM OpenAI server, as a user runs it (`vllm serve` is `python -m vllm.entrypoints.openai.api_server`
under this distribution's name): the reference the parity tests compare Skyline's answers with."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from skyline.core.net import free_port


@contextlib.contextmanager
def reference_server(model: str, extra_args: tuple[str, ...], log_path: Path,
                     env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, URL) of a vLLM server of the default model served as `model`, with `extra_args` (and `env`
    added to its environment), on the first core, logging to `log_path`; started, not waited for
    (`wait_up`), so a fleet can load beside it."""
    from skyline.tools.model import resolve_model
    from skyline.workers.engines import engine_processes

    port = free_port()
    cores = sorted(os.sched_getaffinity(0))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model("default"),
             "--served-model-name", model, "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
             "--host", "127.0.0.1", "--port", str(port), *extra_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(cores[0]),
                     **{engine_processes.PAUSE_ENV: engine_processes.POLL_PAUSE_US}, **(env or {})))
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_up(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 600) -> None:
    """Until the server at `url` lists its models; its log's tail in the error if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"reference vLLM server exited:\n{log_path.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("reference vLLM server did not start")
        time.sleep(1)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


def greedy_answer(client, model: str, kind: str, stream: bool, route: str | None = None,
                  max_tokens: int = 24) -> tuple[str, dict]:
    """(text, the response's `skyline` object or {}) of CHAT (kind "chat") or PROMPT (kind "completion"),
    greedy, from an OpenAI client of the reference server or of a fleet (`route`: x-skyline-route).
    A whole response must name `model`; a streamed one carries no `skyline` object."""
    headers = {"x-skyline-route": route} if route else None
    if kind == "chat":
        kw = dict(model=model, messages=CHAT, max_tokens=max_tokens, temperature=0, extra_headers=headers)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices), {}
        r = client.chat.completions.create(**kw)
        assert r.model == model
        return r.choices[0].message.content, (r.model_extra or {}).get("skyline", {})
    kw = dict(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_headers=headers)
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices), {}
    r = client.completions.create(**kw)
    assert r.model == model
    return r.choices[0].text, (r.model_extra or {}).get("skyline", {})
