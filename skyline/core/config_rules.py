"""What a loaded config must satisfy: each value's type and range, and the rules between values.

`load_config` calls `check` once, so every process refuses a bad config at start with one
message that names each offending key (`[section] key = value: what is wrong`), instead of
misbehaving later (a heartbeat TTL shorter than the heartbeat drops live workers; a batch
pacing floor above its ceiling never paces).
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem, one per line."""


def check(cfg: Any) -> None:
    problems = _types(cfg) or _ranges(cfg) + _cross(cfg)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _at(section: str, key: str, value: Any) -> str:
    return f"{_key(section, key)} = {value!r}"


def _key(section: str, key: str) -> str:
    """A key as the user writes it: EngineConfig's vLLM arguments under vLLM's name, in [engine.vllm]."""
    from skyline.core.engine_args import RENAMED, flag

    if section == "engine" and key in RENAMED:
        return f"[engine.vllm] {flag(RENAMED[key])[2:]}"
    return f"[{section}] {key}"


# -- types ------------------------------------------------------------------------------------


def _types(cfg: Any) -> list[str]:
    """Each field holds its annotated type (TOML gives strings, ints, floats, bools, arrays)."""
    out = []
    for section in fields(cfg):
        sub = getattr(cfg, section.name)
        if not is_dataclass(sub):
            continue
        hints = typing.get_type_hints(type(sub))
        for f in fields(sub):
            value = getattr(sub, f.name)
            if not _is(value, hints[f.name]):
                out.append(f"{_at(section.name, f.name, value)}: expected {_name(hints[f.name])}")
    return out


def _is(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        (item, *_rest) = typing.get_args(hint)
        return isinstance(value, tuple) and all(_is(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_name(h) for h in typing.get_args(hint) if h is not type(None)) + " (or unset)"
    if typing.get_origin(hint) is tuple:
        return f"an array of {_name(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


# -- ranges -----------------------------------------------------------------------------------

# (section, key): (low, high, inclusive low); None = unbounded on that side.
_AT_LEAST_0 = (0, None, True)
_AT_LEAST_1 = (1, None, True)
_POSITIVE = (0, None, False)
_FRACTION = (0, 1, False)  # (0, 1]
_PORT = (0, 65535, True)
RANGES: dict[tuple[str, str], tuple[float | None, float | None, bool]] = {
    ("redis", "stream_maxlen"): _AT_LEAST_1,
    ("redis", "run_ttl_s"): _AT_LEAST_1,
    ("redis", "outage_grace_s"): _AT_LEAST_0,
    ("engine", "max_model_len"): _AT_LEAST_1,
    ("engine", "max_num_batched_tokens"): _AT_LEAST_0,
    ("engine", "kv_block_size"): _AT_LEAST_0,
    ("engine", "long_prefill_token_threshold"): (-1, None, True),
    ("engine", "background_step_tokens"): (-1, None, True),
    ("engine", "hold_background_steps"): _AT_LEAST_0,
    ("engine", "best_effort_step_tokens"): _AT_LEAST_0,
    ("engine", "kv_cache_gib"): _AT_LEAST_0,
    ("engine", "gpu_memory_utilization"): _FRACTION,
    ("engine", "nixl_port"): _PORT,
    ("engine", "kv_lease_s"): _POSITIVE,
    ("engine", "engine_nice"): (-20, 19, True),
    ("engine", "sim_prefill_base_s"): _AT_LEAST_0,
    ("engine", "sim_prefill_per_token_s"): _AT_LEAST_0,
    ("engine", "sim_decode_base_s"): _AT_LEAST_0,
    ("engine", "sim_decode_per_seq_s"): _AT_LEAST_0,
    ("engine", "sim_prefix_cache_blocks"): _AT_LEAST_0,
    ("engine", "sim_max_loras"): _AT_LEAST_0,
    ("engine", "sim_lora_load_s"): _AT_LEAST_0,
    ("worker", "max_running"): _AT_LEAST_1,
    ("worker", "prefill_token_budget"): _AT_LEAST_1,
    ("worker", "kv_watermark"): _FRACTION,
    ("worker", "tpot_headroom"): _AT_LEAST_0,
    ("worker", "tpot_window_s"): _POSITIVE,
    ("worker", "max_preemptions"): _AT_LEAST_0,
    ("worker", "prior_prefill_tokens_per_s"): _POSITIVE,
    ("worker", "heartbeat_s"): _POSITIVE,
    ("worker", "heartbeat_ttl_s"): _POSITIVE,
    ("worker", "metrics_port"): _PORT,
    ("worker", "reclaim_after_s"): _POSITIVE,
    ("worker", "reclaim_interval_s"): _POSITIVE,
    ("worker", "max_deliveries"): _AT_LEAST_1,
    ("worker", "drain_timeout_s"): _AT_LEAST_0,
    ("worker", "engine_stall_s"): _AT_LEAST_0,
    ("gateway", "port"): _PORT,
    ("gateway", "min_remote_prefill_tokens"): _AT_LEAST_0,
    ("gateway", "max_prefill_backlog_tokens"): _AT_LEAST_0,
    ("gateway", "rate_limit_rps"): _AT_LEAST_0,
    ("gateway", "rate_limit_burst"): _AT_LEAST_1,
    ("gateway", "tenant_tokens_per_minute"): _AT_LEAST_0,
    ("gateway", "affinity_min_blocks"): _AT_LEAST_1,
    ("gateway", "affinity_load_blocks"): _AT_LEAST_0,
    ("gateway", "affinity_slack_share"): _FRACTION,
    ("gateway", "affinity_max_wait_ms"): _AT_LEAST_0,
    ("gateway", "affinity_max_blocks"): _AT_LEAST_1,
    ("worker", "cache_view_max_blocks"): _AT_LEAST_0,
    ("gateway", "max_body_bytes"): _AT_LEAST_1,
    ("gateway", "max_header_bytes"): _AT_LEAST_1,
    ("gateway", "response_store_ttl_s"): _AT_LEAST_0,
    ("gateway", "response_store_max_bytes"): _AT_LEAST_0,
    ("gateway", "request_timeout_s"): _POSITIVE,
    ("gateway", "first_frame_timeout_s"): _POSITIVE,
    ("gateway", "worker_liveness_s"): _POSITIVE,
    ("gateway", "first_token_overhead_ms"): _AT_LEAST_0,
    ("gateway", "max_queued_tokens"): _AT_LEAST_1,
    ("gateway", "best_effort_max_wait_s"): _AT_LEAST_0,
    ("observability", "timeline_ttl_s"): _AT_LEAST_1,
    ("observability", "timeline_max_events"): _AT_LEAST_1,
    ("observability", "slo_window_minutes"): _AT_LEAST_1,
    ("observability", "recent_requests"): _AT_LEAST_1,
    ("batch", "max_file_bytes"): _AT_LEAST_1,
    ("batch", "max_lines"): _AT_LEAST_1,
    ("batch", "file_ttl_s"): _AT_LEAST_0,
    ("batch", "min_concurrency"): _AT_LEAST_1,
    ("batch", "max_concurrency"): _AT_LEAST_1,
    ("batch", "start_concurrency"): _AT_LEAST_1,
    ("batch", "backoff_tokens"): _AT_LEAST_0,
    ("batch", "fill_tokens"): _AT_LEAST_0,
    ("batch", "max_batch_backlog_tokens"): _AT_LEAST_1,
    ("batch", "backoff_slo_pressure"): _POSITIVE,
    ("batch", "fill_slo_pressure"): _AT_LEAST_0,
    ("batch", "pacing_interval_s"): _POSITIVE,
    ("batch", "max_attempts"): _AT_LEAST_1,
    ("batch", "job_retries"): _AT_LEAST_0,
    ("batch", "heartbeat_s"): _AT_LEAST_1,
    ("batch", "lease_s"): _AT_LEAST_1,
    ("batch", "maintenance_interval_s"): _AT_LEAST_1,
}
CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("engine", "kind"): ("vllm", "sim"),
    ("engine", "dtype"): ("auto", "float32", "float16", "bfloat16", "half", "float"),
    ("worker", "role"): ("prefill", "decode", "elastic"),
    ("gateway", "mode"): ("disagg", "colocated"),
    ("observability", "log_format"): ("text", "json"),
}


def _ranges(cfg: Any) -> list[str]:
    out = []
    for (section, key), (low, high, low_inclusive) in RANGES.items():
        value = getattr(getattr(cfg, section), key)
        if value is None:
            continue
        too_low = low is not None and (value < low if low_inclusive else value <= low)
        if too_low or (high is not None and value > high):
            if high is None:
                want = f"at least {low}" if low_inclusive else f"above {low}"
            else:
                want = f"from {low} to {high}" if low_inclusive else f"above {low} and at most {high}"
            out.append(f"{_at(section, key, value)}: must be {want}")
    for (section, key), allowed in CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            out.append(f"{_at(section, key, value)}: must be one of {', '.join(allowed)}")
    if not cfg.key_prefix or any(c.isspace() or c in "{}:" for c in cfg.key_prefix):
        out.append(f"key_prefix = {cfg.key_prefix!r}: must be non-empty, without spaces, braces or colons")
    names = [t.name for t in cfg.tiers]
    if len(set(names)) != len(names):
        out.append(f"[tiers]: tier names must be unique, got {names}")
    for t in cfg.tiers:
        for key in ("ttft_ms", "tpot_ms"):
            if not isinstance(getattr(t, key), int) or getattr(t, key) <= 0:
                out.append(f"[tiers.{t.name}] {key} = {getattr(t, key)!r}: must be a positive integer")
        if not isinstance(t.drop_late_ms, int) or t.drop_late_ms < -1:
            out.append(f"[tiers.{t.name}] drop_late_ms = {t.drop_late_ms!r}: must be -1 (always serve) or at least 0")
    return out


# -- rules between values ---------------------------------------------------------------------


def _cross(cfg: Any) -> list[str]:
    w, g, b, r = cfg.worker, cfg.gateway, cfg.batch, cfg.redis
    tiers = cfg.tier_names
    out = []

    def rule(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    rule(w.heartbeat_ttl_s > w.heartbeat_s,
         f"[worker] heartbeat_ttl_s = {w.heartbeat_ttl_s} must exceed heartbeat_s = {w.heartbeat_s} "
         "(else a live worker's registry entry expires between its beats)")
    rule(w.reclaim_after_s > w.heartbeat_s,
         f"[worker] reclaim_after_s = {w.reclaim_after_s} must exceed heartbeat_s = {w.heartbeat_s} "
         "(else live workers' requests are taken over)")
    rule(g.worker_liveness_s <= w.heartbeat_ttl_s,
         f"[gateway] worker_liveness_s = {g.worker_liveness_s} must be at most [worker] heartbeat_ttl_s = "
         f"{w.heartbeat_ttl_s} (the registry forgets a worker after that)")
    rule(g.worker_liveness_s > w.heartbeat_s,
         f"[gateway] worker_liveness_s = {g.worker_liveness_s} must exceed [worker] heartbeat_s = {w.heartbeat_s} "
         "(else the gateway sees live workers as gone between beats)")
    rule(w.engine_stall_s == 0 or w.engine_stall_s + w.reclaim_after_s < g.first_frame_timeout_s,
         f"[worker] engine_stall_s = {w.engine_stall_s} + reclaim_after_s = {w.reclaim_after_s} must be under "
         f"[gateway] first_frame_timeout_s = {g.first_frame_timeout_s} (else the clients of a stuck engine get "
         "a 503 before a live worker takes their requests over), or 0")
    rule(g.first_frame_timeout_s <= g.request_timeout_s,
         f"[gateway] first_frame_timeout_s = {g.first_frame_timeout_s} must be at most request_timeout_s = "
         f"{g.request_timeout_s}")
    # A key in both lists would make a tenant an operator without anyone noticing (never named: it is a secret).
    rule(not set(g.api_keys) & set(g.operator_api_keys),
         "[gateway] a key is in both api_keys and operator_api_keys: give operators keys of their own")
    rule(r.run_ttl_s > g.request_timeout_s,
         f"[redis] run_ttl_s = {r.run_ttl_s} must exceed [gateway] request_timeout_s = {g.request_timeout_s} "
         "(a request's delivery state must outlive the request)")
    rule(g.response_store_ttl_s == 0 or g.response_store_ttl_s > g.request_timeout_s,
         f"[gateway] response_store_ttl_s = {g.response_store_ttl_s} must exceed request_timeout_s = "
         f"{g.request_timeout_s} (a background response must outlive its run), or be 0 (no store)")
    rule(cfg.default_tier in tiers, f"default_tier = {cfg.default_tier!r} is not one of the tiers {tiers}")
    # Tiers named by a setting the operator wrote must exist; the defaults name the default
    # tiers and are harmless in a fleet with tiers of its own (no request can be in them).
    if g.sheddable_tiers != type(g)().sheddable_tiers:
        for tier in g.sheddable_tiers:
            rule(tier in tiers, f"[gateway] sheddable_tiers names {tier!r}, which is not one of the tiers {tiers}")
    if g.tenant_strictest_tier:
        rule(g.tenant_strictest_tier in tiers,
             f"[gateway] tenant_strictest_tier = {g.tenant_strictest_tier!r} is not one of the tiers {tiers}")
    for k in g.key_options:  # named by file and line: the key is a secret
        rule(not k.strictest_tier or k.strictest_tier in tiers,
             f"{k.where}: strictest_tier={k.strictest_tier!r} is not one of the tiers {tiers}")
    if b.tier != type(b)().tier:
        rule(b.tier in tiers, f"[batch] tier = {b.tier!r} is not one of the tiers {tiers}")
    rule(b.min_concurrency <= b.start_concurrency <= b.max_concurrency,
         f"[batch] min_concurrency = {b.min_concurrency}, start_concurrency = {b.start_concurrency}, "
         f"max_concurrency = {b.max_concurrency}: must be min <= start <= max")
    rule(b.fill_tokens <= b.backoff_tokens,
         f"[batch] fill_tokens = {b.fill_tokens} must be at most backoff_tokens = {b.backoff_tokens}")
    rule(b.fill_slo_pressure <= b.backoff_slo_pressure,
         f"[batch] fill_slo_pressure = {b.fill_slo_pressure} must be at most backoff_slo_pressure = "
         f"{b.backoff_slo_pressure}")
    rule(b.lease_s > b.heartbeat_s,
         f"[batch] lease_s = {b.lease_s} must exceed heartbeat_s = {b.heartbeat_s} "
         "(else a running batch job is taken as abandoned)")
    e = cfg.engine
    if e.max_num_batched_tokens:
        rule(e.prefill_cap() <= e.max_num_batched_tokens,
             f"{_at('engine', 'long_prefill_token_threshold', e.long_prefill_token_threshold)} must be at most "
             f"{_at('engine', 'max_num_batched_tokens', e.max_num_batched_tokens)}")
    return out
