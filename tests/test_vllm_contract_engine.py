"""The engine side's contract with vLLM: every internal workers/engines/vllm_internals.py relies on
(module, class, method, the parameters passed, the fields read, the source text a patch assumes)
is there in the installed vLLM. A vLLM upgrade that moved one fails here, naming it, before any
engine starts (docs/vllm-versions.md). The serving side's: tests/test_vllm_contract_serving.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from skyline.core.vllm_contract import SUPPORTED_VLLM, Internal, VllmDrift, installed_vllm
from skyline.workers.engines import vllm_internals

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("internal", vllm_internals.CONTRACT, ids=lambda i: i.qualname)
def test_the_engine_side_internal_is_there(internal: Internal):
    internal.check()


def test_the_installed_vllm_is_the_supported_one():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    pinned = [re.fullmatch(r"vllm(?:-cpu)?==(\S+)", p) for p in pins]
    assert [m.group(1) for m in pinned if m] == [SUPPORTED_VLLM], "pyproject's vLLM pin and SUPPORTED_VLLM differ"
    assert installed_vllm() == SUPPORTED_VLLM


def test_the_contract_fails_loudly_on_what_moved():
    """What the checks above and the adapter raise when something moved: the internal, the problem,
    the supported version."""
    cases = [
        (Internal("vllm.v1.core.sched.no_such_module", "Scheduler"), "cannot be imported"),
        (Internal("vllm.v1.core.sched.scheduler", "Scheduler.no_such_method"), "has no attribute 'no_such_method'"),
        (Internal("vllm.v1.core.sched.scheduler", "Scheduler.schedule", params=("budget",)), "no parameter 'budget'"),
        (Internal("vllm.v1.request", "Request", fields=("no_such_field",)), "no field 'no_such_field'"),
        (Internal("vllm.v1.core.sched.scheduler", "Scheduler.schedule", source=("no such text",)), "no longer holds"),
    ]
    for internal, problem in cases:
        with pytest.raises(VllmDrift, match=re.escape(problem)) as err:
            internal.check()
        assert internal.qualname in str(err.value) and SUPPORTED_VLLM in str(err.value)


def test_the_step_shaping_schedulers_subclass_vllms():
    from skyline.workers.engines import vllm_scheduler

    sync_cls, async_cls = vllm_internals.scheduler_classes()
    assert issubclass(vllm_scheduler.StepShapingScheduler, sync_cls)
    assert issubclass(vllm_scheduler.StepShapingAsyncScheduler, async_cls)


def test_a_step_report_reads_vllms_scheduler_stats():
    from vllm.v1.metrics.stats import SchedulerIterationDetails, SchedulerStats

    reports = []
    tap = vllm_internals.stat_logger_factory(reports.append)(None, 0)
    step = SchedulerIterationDetails(iteration_index=3, num_ctx_requests=1, num_ctx_tokens=96,
                                     num_generation_requests=2, num_generation_tokens=2, elapsed_ms=12.5,
                                     num_encoder_inputs=0, num_encoder_output_tokens=0, is_dummy=False)
    tap.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, num_skipped_waiting_reqs=1,
                              kv_cache_usage=0.25, iteration_details=step), None)
    tap.record(SchedulerStats(num_running_reqs=1), None)
    tap.record(None, None)
    assert reports == [vllm_internals.StepReport(3, 2, 0.25, 96, 2, 12.5, has_step=True),
                       vllm_internals.StepReport(1, 0, 0.0)]


def test_kv_events_decode_with_vllms_types():
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    batch = KVEventBatch(ts=0.0, events=[BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[5] * 4,
                                                     block_size=4, lora_id=None, medium="GPU", lora_name=None)])
    decoded = msgspec.msgpack.Decoder(vllm_internals.kv_event_batch_type()).decode(msgspec.msgpack.encode(batch))
    assert isinstance(decoded.events[0], vllm_internals.kv_event_types()[1])
    config = vllm_internals.kv_events_config("ipc:///tmp/x", 7)
    assert (config.endpoint, config.hwm, config.enable_kv_cache_events) == ("ipc:///tmp/x", 7, True)


def test_vllm_loads_the_engine_process_plugin_from_the_installed_metadata():
    """The entry point vLLM loads in every engine process names Skyline's module as it is now (stale
    package metadata would make vLLM log "Failed to load plugin" and run its engines unpatched)."""
    from importlib.metadata import entry_points

    from skyline.workers.engines import engine_processes

    ours = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("skyline.")]
    assert [(ep.name, ep.load()) for ep in ours] == [("skyline_engine_processes", engine_processes.register)]
