"""A pytest plugin for vLLM's own tests (`tests/entrypoints/openai` of the installed vLLM's source release):
it points their server fixture, `tests.utils.RemoteOpenAIServer`, at the server this run is about.

Loaded by `tests/vllm_suite/run.py` (`-p skyline_vllm_suite`, this folder on PYTHONPATH), in the folder the
source release's `tests/` were unpacked to. `SKYLINE_VLLM_SUITE_TARGET` picks the server:

- `vllm`: `vllm serve` itself (the reference: a test that fails here cannot be held against Skyline);
- `disagg`: `skyline up --prefill 1 --decode 1` with every prompt computed on the prefill engine and its KV
  moved over NIXL to the decode engine;
- `colocated`: `skyline up --mode colocated`: one engine computes and decodes each request.

Each test module asks for its model by hub id; this machine has one model, the default one, which every
hub id the tests name is served as (a folder named like the id, beside the tests, links to it: vLLM's
`serve` and `get_tokenizer`, Transformers' `from_pretrained` all take a local folder before the hub). The
tests' own arguments go to `vllm serve` or `skyline up` unchanged; both get the same CPU settings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from skyline.core import envs
from skyline.tools.bench.simfleet import wait_for_workers

TARGET_ENV = envs.VLLM_SUITE_TARGET.name
MODEL_ENV = envs.VLLM_SUITE_MODEL.name  # the default model's folder (run.py resolves it once)
TARGETS = ("vllm", "disagg", "colocated")
# What every server gets on this machine, as the differential tier's reference gets it: float32 (bfloat16
# gave garbage with the default model on CPU) and a small KV cache (two cores, shared with the tests).
CPU_ARGS = ("--dtype", "float32")
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def target() -> str:
    value = envs.VLLM_SUITE_TARGET.get()
    if value not in TARGETS:
        raise pytest.UsageError(f"{TARGET_ENV}={value!r}: expected one of {', '.join(TARGETS)}")
    return value


def link_model(name: str, model_dir: str) -> None:
    """A folder `name` (a hub id, relative to the working directory) that is the default model."""
    path = Path(name)
    if path.is_absolute() or name.startswith(".") or path.exists() or path.is_symlink():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(model_dir, target_is_directory=True)


def _with_cpu_args(args: list[str]) -> list[str]:
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    out = list(args)
    for flag, value in zip(CPU_ARGS[::2], CPU_ARGS[1::2]):
        if flag not in given:
            out += [flag, value]
    return out


def _skyline_up(model: str, args: list[str], env: dict[str, str], route: str, port: int) -> subprocess.Popen:
    """`skyline up` of `model` with the test's vLLM arguments, its gateway on `port`."""
    from skyline.core.net import free_port

    home = Path(tempfile.mkdtemp(prefix="skyline-vllm-suite-"))
    config = home / "suite.toml"
    # disagg: every prompt goes to the prefill engine, however short (the default keeps prompts under
    # 256 tokens on the decode engine, which would leave the NIXL path untested by these short prompts).
    config.write_text("[gateway]\nmin_remote_prefill_tokens = 0\n" if route == "disagg" else "")
    pools = ["--prefill", "1", "--decode", "1"] if route == "disagg" else ["--mode", "colocated", "--decode", "1"]
    # The tests pass --port and --seed to every server: the gateway takes --port; --seed is an engine argument.
    rest, i = [], 0
    while i < len(args):
        if args[i] in ("--port", "--host"):
            i += 2
            continue
        rest.append(args[i])
        i += 1
    # The hub id is a local folder here (`link_model`), which Skyline serves under the folder's own name
    # (vllm serve: the path as given); a hub id proper is served as given by both, as named here.
    if "--served-model-name" not in rest:
        rest += ["--served-model-name", model]
    cmd = [sys.executable, "-m", "skyline.cli", "up", "--config", str(config), *pools, "--port", str(port),
           "--redis-port", str(free_port()), "--metrics-port-base", "0", "--model", model, *rest]
    print(f"Launching Skyline ({route}) with: {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, env=dict(env, SKYLINE_HOME=str(home)), stdout=sys.stdout, stderr=sys.stderr,
                            start_new_session=True)


def pytest_configure(config: pytest.Config) -> None:
    chosen = target()
    model_dir = envs.VLLM_SUITE_MODEL.get()
    from tests import utils  # vLLM's tests/utils.py (the rootdir is the unpacked source release)

    server_cls = utils.RemoteOpenAIServer
    original_init = server_cls.__init__

    def __init__(self, model: str, vllm_serve_args: list[str], *args, **kwargs):
        link_model(model, model_dir)
        original_init(self, model, _with_cpu_args(list(vllm_serve_args)), *args, **kwargs)

    def _pre_download_model(self, model: str, args) -> None:
        link_model(model, model_dir)  # the hub is not reached: every model is the default one

    def _start_server(self, model: str, vllm_serve_args: list[str], env_dict: dict[str, str] | None) -> None:
        env = dict(os.environ, **CPU_ENV, **(env_dict or {}))
        env.pop(TARGET_ENV, None)
        if chosen == "vllm":
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *vllm_serve_args]
            print(f"Launching vllm serve with: {' '.join(cmd)}", flush=True)
            self.proc = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr, start_new_session=True)
            return
        self.proc = _skyline_up(model, vllm_serve_args, env, chosen, self.port)
        want = {"prefill": 1, "decode": 1} if chosen == "disagg" else {"decode": 1}
        def alive() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"skyline up exited with {self.proc.returncode} during start-up")

        if not wait_for_workers(f"http://{self.host}:{self.port}", want, 600, alive):
            raise TimeoutError(f"the Skyline fleet on port {self.port} was not ready in 600 s")

    def _terminate_process_tree(self) -> None:
        proc = self.proc
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # `skyline up` stops its fleet on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    server_cls.__init__ = __init__
    server_cls._pre_download_model = _pre_download_model
    server_cls._start_server = _start_server
    if chosen != "vllm":
        server_cls._terminate_process_tree = _terminate_process_tree
    config.stash[_TARGET] = chosen


_TARGET = pytest.StashKey[str]()


def pytest_report_header(config: pytest.Config) -> str:
    return f"skyline vLLM suite: target {config.stash.get(_TARGET, '?')}, model {envs.VLLM_SUITE_MODEL.get()}"
