"""vLLM's engine arguments, under vLLM's own names, parsed and checked by vLLM's own parser.

A worker's engine takes every argument `vllm serve` takes for its engine (`--tensor-parallel-size 2`,
`--max-num-seqs 256`, `--quantization fp8`, ...), from the command line (`skyline worker ROLE ...`,
`skyline up ...`) and from the config file (`[engine.vllm]` for every engine, `[engine.vllm.prefill]`,
`[engine.vllm.decode]`, `[engine.vllm.elastic]` per role). vLLM's `AsyncEngineArgs.add_cli_args` builds
the parser and `AsyncEngineArgs.from_cli_args` the engine's arguments, so a bad value gets vLLM's own
message and a vLLM upgrade brings its new arguments with no change here; no list of vLLM's arguments is
kept in Skyline.

Precedence, lowest first: Skyline's defaults for this machine kind (float32, 2048 context, 256-token
steps, eager), `[engine.vllm]`, `[engine.vllm.<role>]`, the command line's arguments for every engine,
then its arguments for the role (`skyline up --decode-engine-args "..."`).

An argument that would change what Skyline must control (the KV connector it hands KV over with, the
KV events it builds the fleet's cache view from, the step-shaping scheduler it installs, ...) is
refused at start with the reason (`refusals`), never silently overridden.

The config loader reads the tables without vLLM (`split_table`, `from_table`: a process that never
starts an engine never imports vLLM); `resolve` parses them with vLLM's parser where an engine is
started (`skyline worker`, and `skyline up` before it starts anything).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyline.core.config import EngineConfig

ROLES = ("prefill", "decode", "elastic")

# Skyline's former [engine] keys that are vLLM engine arguments: {old key: vLLM's name (its dest)}.
# The key still loads, with a warning naming the new one; EngineConfig keeps the value under the old
# name for Skyline's own code (the gateway's context length, the step shape, the sim engine).
RENAMED = {
    "model": "model",
    "served_model_name": "served_model_name",
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "kv_block_size": "block_size",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "gpu_memory_utilization": "gpu_memory_utilization",
}
FIELD_OF = {dest: key for key, dest in RENAMED.items()}

# Arguments every engine of a fleet must share: a prefill engine's KV is decoded by another engine,
# and the gateway renders and checks every request for all of them with one tokenizer and context length.
SHARED = {
    "model": "the KV a prefill engine computes is decoded by another engine: same weights",
    "served_model_name": "the gateway serves one name for the fleet's engines",
    "tokenizer": "the gateway tokenizes each request once, for every engine",
    "revision": "the KV a prefill engine computes is decoded by another engine: same weights",
    "max_model_len": "the gateway checks each request against one context length",
    "dtype": "KV moves between engines as it is: the same dtype on both sides",
    "kv_cache_dtype": "KV moves between engines as it is: the same dtype on both sides",
    "enable_lora": "KV computed with an adapter is decoded with it: every engine serves the fleet's adapters",
    "max_lora_rank": "every engine loads each of the fleet's adapters",
}
# Arguments of `vllm serve` that are not the engine's: taken by the worker, never passed to vLLM's engine.
SERVING_ONLY = ("lora_modules",)


class EngineArgsError(ValueError):
    """A bad engine argument: vLLM's message, or Skyline's reason for refusing it."""


def dest(name: str) -> str:
    """vLLM's dest of an argument written either way: `max-num-seqs`, `--max_num_seqs` -> max_num_seqs."""
    return name.lstrip("-").replace("-", "_")


def flag(dest_name: str) -> str:
    return "--" + dest_name.replace("_", "-")


# -- the config file's tables (no vLLM needed) --------------------------------------------------


@dataclass(frozen=True)
class VllmArgs:
    """The engine arguments a user gave: the config's tables (TOML values, names as vLLM's dests) and
    the command line's (argv as typed), each for every engine and per role."""

    table: dict[str, Any] = field(default_factory=dict)  # [engine.vllm]
    role_tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # [engine.vllm.<role>]
    argv: tuple[str, ...] = ()  # `skyline worker ROLE ...` / `skyline up ...`: every engine
    role_argv: dict[str, tuple[str, ...]] = field(default_factory=dict)  # `skyline up --<role>-engine-args "..."`

    def __bool__(self) -> bool:
        return bool(self.table or any(self.role_tables.values()) or self.argv or any(self.role_argv.values()))

    def tables_for(self, role: str | None) -> dict[str, Any]:
        """The config's values for an engine of `role` (None: every engine's only)."""
        return {**self.table, **(self.role_tables.get(role, {}) if role else {})}

    def layers(self, role: str | None) -> list[tuple[str, list[str]]]:
        """(where, argv) of each place an engine of `role` gets arguments from, lowest precedence first:
        parsed one by one (vLLM's parser warns of an argument given twice in one command line)."""
        out = [("[engine.vllm]", table_argv(self.table))]
        if role:
            out.append((f"[engine.vllm.{role}]", table_argv(self.role_tables.get(role, {}))))
        out.append(("the command line", list(self.argv)))
        if role:
            out.append((f"--{role}-engine-args", list(self.role_argv.get(role, ()))))
        return [(where, argv) for where, argv in out if argv]


def split_table(table: dict[str, Any]) -> VllmArgs:
    """`[engine.vllm]` as TOML gives it: every engine's arguments and the role sub-tables; names
    either way (dashed as `vllm serve` spells them, or underscored) become vLLM's dests."""
    every: dict[str, Any] = {}
    roles: dict[str, dict[str, Any]] = {}
    for name, value in table.items():
        if name in ROLES:
            if not isinstance(value, dict):
                raise EngineArgsError(f"[engine.vllm.{name}] must be a table of vLLM engine arguments")
            roles[name] = {dest(k): v for k, v in value.items()}
            continue
        every[dest(name)] = value
    for role, values in roles.items():
        for name in values:
            if name in SHARED:
                raise EngineArgsError(f"[engine.vllm.{role}] {flag(name)[2:]}: must be the same for every engine "
                                      f"({SHARED[name]}); set it in [engine.vllm]")
    return VllmArgs(table=every, role_tables=roles)


def table_argv(table: dict[str, Any]) -> list[str]:
    """A table of engine arguments as a command line, the way vLLM reads its own YAML config files
    (FlexibleArgumentParser.load_config_file): true -> --flag, false -> --no-flag, a list -> its items,
    a table -> JSON."""
    out: list[str] = []
    for name, value in table.items():
        option = flag(name)
        if isinstance(value, bool):
            out.append(option if value else "--no-" + option[2:])
        elif isinstance(value, list):
            out += [option, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            out += [option, json.dumps(value)]
        else:
            out += [option, str(value)]
    return out


def from_table(values: dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig fields a table of engine arguments sets (Skyline's names), where TOML gave
    them typed; `resolve` sets them from vLLM's parse in a process that starts an engine."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        key = FIELD_OF.get(name)
        if key is None:
            continue
        if key == "served_model_name" and isinstance(value, list):
            value = value[0] if len(value) == 1 else value  # more than one: refused by config_rules
        if key == "kv_block_size" and value is None:
            value = 0
        out[key] = value
    return out


def split_argv(text: str) -> tuple[str, ...]:
    """`--decode-engine-args "--max-num-seqs 256 -tp 2"` as a command line."""
    return tuple(shlex.split(text or ""))


# -- vLLM's parser -------------------------------------------------------------------------------


_PARSER: Any = None
_DEFAULTS: dict[str, Any] = {}


def parser() -> Any:
    """vLLM's engine-argument parser (AsyncEngineArgs.add_cli_args), raising EngineArgsError with vLLM's
    message instead of exiting; every default suppressed, so a parse holds what was given and nothing else."""
    global _PARSER
    if _PARSER is None:
        import argparse

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        class Parser(FlexibleArgumentParser):
            def error(self, message: str):  # type: ignore[override]
                if message.startswith("unrecognized arguments:"):
                    import difflib

                    for word in message.split(":", 1)[1].split():
                        if word.startswith("--"):
                            known = [o for o in self._option_string_actions if o.startswith("--")]
                            guess = difflib.get_close_matches(word.split("=", 1)[0].replace("_", "-"), known, n=1)
                            if guess:
                                message += f" (did you mean {guess[0]}?)"
                                break
                raise EngineArgsError(message)

        p = Parser(prog="vLLM engine arguments", add_help=False)
        AsyncEngineArgs.add_cli_args(p)
        # `vllm serve`'s one serving-layer argument an engine's worker takes: its static LoRA adapters,
        # parsed by vLLM's own action (a list of LoRAModulePath). The worker registers them in the
        # fleet's adapter registry (skyline/core/adapters.py); the engine itself never sees it.
        from vllm.entrypoints.launchers.cli_args import LoRAParserAction

        p.add_argument("--lora-modules", type=str, nargs="+", action=LoRAParserAction, default=None,
                       help="LoRA adapters served from the start: name=path or JSON, as vllm serve takes them")
        for action in p._actions:
            if action.default is not argparse.SUPPRESS:
                if isinstance(action.default, str):  # as argparse itself applies a string default
                    _DEFAULTS[action.dest] = p._get_value(action, action.default)
                else:
                    _DEFAULTS[action.dest] = action.default
            action.default = argparse.SUPPRESS
        _PARSER = p
    return _PARSER


def parse(argv: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """{dest: value} for each argument in `argv`, parsed and checked by vLLM's parser (its message on
    a bad value, an unknown name)."""
    p = parser()
    if "--config" in argv:  # FlexibleArgumentParser would read it as a YAML file of its own
        raise EngineArgsError("--config is Skyline's TOML file; write engine arguments in its [engine.vllm] table")
    try:
        return vars(p.parse_args(list(argv)))
    except EngineArgsError:
        raise
    except (ValueError, TypeError) as exc:  # some of vLLM's own checks raise instead of calling error()
        raise EngineArgsError(str(exc)) from exc


def defaults() -> dict[str, Any]:
    """vLLM's own defaults of every engine argument (what `vllm serve` would run with)."""
    parser()
    return dict(_DEFAULTS)


# -- what Skyline controls -----------------------------------------------------------------------


def skyline_installs_scheduler(ec: EngineConfig, role: str) -> bool:
    """Whether an engine of `role` runs Skyline's step-shaping scheduler (VllmEngine._engine_args)."""
    step = ec.max_num_batched_tokens
    relaxed = ec.best_effort_step_tokens if step and ec.best_effort_step_tokens > step else 0
    return bool(ec.background_tokens(role) > 0 or ec.hold_background_steps > 0 or relaxed)


def refusals(given: dict[str, Any], ec: EngineConfig, role: str | None) -> list[str]:
    """Why each given argument that conflicts with what Skyline controls cannot be taken (empty: all can).
    `role` None: the arguments for every engine, checked against each role's."""
    out: list[str] = []

    def refuse(name: str, why: str) -> None:
        out.append(f"{flag(name)} = {_show(given[name])}: {why}")

    if "kv_transfer_config" in given:
        refuse("kv_transfer_config", "Skyline configures the KV connector of every engine (vLLM's NixlConnector, "
               "kv_both, with its lease): prefill engines hand KV to decode engines through it. "
               "[engine] kv_transfer = false runs an engine without one (a colocated fleet)")
    if given.get("kv_offloading_size") is not None and ec.kv_transfer:
        refuse("kv_offloading_size", "vLLM would replace the engine's NIXL connector with its offloading "
               "connector; only with [engine] kv_transfer = false (a colocated fleet)")
    if "kv_events_config" in given and ec.prefix_cache_events:
        refuse("kv_events_config", "Skyline subscribes to the engine's KV cache events for the fleet's "
               "prefix-cache view; [engine] prefix_cache_events = false leaves them to you")
    roles = (role,) if role else ROLES
    if "scheduler_cls" in given and any(skyline_installs_scheduler(ec, r) for r in roles):
        refuse("scheduler_cls", "Skyline installs its step-shaping scheduler (a subclass of vLLM's: short steps "
               "for urgent work); [engine] background_step_tokens = 0, hold_background_steps = 0 and "
               "best_effort_step_tokens = 0 leave the scheduler to you")
    if given.get("scheduling_policy", "priority") != "priority":
        refuse("scheduling_policy", "Skyline runs every engine with vLLM's priority policy: a request's SLO tier "
               "is its priority in the engine")
    if given.get("disable_log_stats"):
        refuse("disable_log_stats", "the worker's load reports (running, waiting, KV usage) come from vLLM's stats")
    if given.get("enable_logging_iteration_details") is False:
        refuse("enable_logging_iteration_details", "each step's tokens and time are the worker's measured "
               "rates (admission, claim defer)")
    additional = given.get("additional_config")
    if isinstance(additional, dict) and "skyline_step" in additional:
        refuse("additional_config", "its key skyline_step is the step-shaping scheduler's settings, written by "
               "Skyline from [engine]; other keys are passed on")
    if given.get("data_parallel_size", 1) != 1:
        refuse("data_parallel_size", "one engine per worker: scale out with more workers (each claims, heartbeats "
               "and is reclaimed on its own); --tensor-parallel-size / --pipeline-parallel-size split one engine")
    names = given.get("served_model_name")
    if isinstance(names, list) and len(names) > 1:
        refuse("served_model_name", "the gateway serves one name for the fleet's model")
    ranks = int(given.get("tensor_parallel_size", 1)) * int(given.get("pipeline_parallel_size", 1))
    if ec.kind == "vllm" and ec.cpu_bind and ec.cpu_bind not in ("auto", "nobind") \
            and ec.cpu_bind.count("|") + 1 != ranks:
        name = "tensor_parallel_size" if "tensor_parallel_size" in given else "pipeline_parallel_size"
        out.append(f"{flag(name)} = {given.get(name, 1)}: --cpu-bind {ec.cpu_bind!r} gives "
                   f"{ec.cpu_bind.count('|') + 1} core set(s) for an engine of {ranks} rank(s); vLLM's CPU backend "
                   "binds each rank to a set of its own: one per rank, separated by | (e.g. 0|1)")
    if given.get("lora_modules") and not given.get("enable_lora"):
        refuse("lora_modules", "its adapters need an engine with LoRA: add --enable-lora (as vllm serve)")
    if (mml := given.get("max_model_len")) is not None and mml < 1:
        refuse("max_model_len", "the gateway checks each request against the context length: give it")
    return out


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- resolution ----------------------------------------------------------------------------------


def resolve(ec: EngineConfig, role: str | None) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine config of an engine of `role` (None: every engine's arguments only) and the arguments
    its user gave ({vLLM dest: value}), parsed by vLLM's parser; what conflicts with Skyline is refused;
    the EngineConfig fields that are vLLM arguments are set from them. Raises EngineArgsError. Idempotent."""
    given: dict[str, Any] = {}
    for where, argv in ec.vllm.layers(role):
        try:
            layer = parse(argv)
        except EngineArgsError as exc:
            raise EngineArgsError(f"{where}: {exc}") from None
        if where.startswith("--"):  # one role's, from `skyline up`
            for name in set(layer) & set(SHARED):
                raise EngineArgsError(f"{where}: {flag(name)} must be the same for every engine ({SHARED[name]}); "
                                      "give it for every engine")
        given.update(layer)  # a later place's value replaces an earlier one's whole (a JSON argument too)
    values = from_table(given)
    if values.get("max_num_batched_tokens", 0) is None:
        values["max_num_batched_tokens"] = 0
    problems = refusals(given, ec, role)
    if not problems:
        ec = replace(ec, **{k: v for k, v in values.items() if k != "served_model_name" or isinstance(v, str)})
        problems = refusals(given, ec, role)  # with the step the arguments set (the scheduler rule reads it)
    if problems:
        where = f"{role} engines" if role else "every engine"
        raise EngineArgsError(f"engine arguments refused ({where}):\n  " + "\n  ".join(problems))
    return ec, given


def ranks(ec: EngineConfig, role: str | None) -> int:
    """Processes of one engine of `role`: vLLM runs one per tensor- and pipeline-parallel rank (on CPUs
    each bound to a core set of its own). The fleet reserves as many NIXL side-channel ports per engine:
    vLLM 0.32 listens on one (base + the data-parallel index), earlier releases on one per rank."""
    if not ec.vllm:
        return 1
    given = resolve(ec, role)[1]
    return int(given.get("tensor_parallel_size", 1)) * int(given.get("pipeline_parallel_size", 1))


def engine_args(given: dict[str, Any], skyline: dict[str, Any]) -> Any:
    """vLLM's AsyncEngineArgs for an engine: vLLM's defaults, the user's arguments, then what Skyline sets
    (`skyline`: values it derives from the user's or controls; refused above where they conflict), built by
    vLLM's own `from_cli_args`, so every argument vLLM has reaches the engine."""
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs

    values = defaults()
    values.update({k: v for k, v in given.items() if k not in SERVING_ONLY})
    for name in RENAMED.values():  # Skyline's fields carry them (resolve), with Skyline's meaning of 0 and -1
        if name != "served_model_name":
            values[name] = _DEFAULTS.get(name)
    for name, value in skyline.items():
        if name == "additional_config":
            value = {**(given.get(name) or {}), **value}
        elif name in given and name not in FIELD_OF and given[name] != value:
            raise EngineArgsError(f"{flag(name)} = {_show(given[name])}: Skyline sets it to {_show(value)} "
                                  "(refused at start: skyline/core/engine_args.py refusals)")
        values[name] = value
    return AsyncEngineArgs.from_cli_args(argparse.Namespace(**values))
