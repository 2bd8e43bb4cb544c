"""Adapter-aware placement (scheduler/adapters.py): pure policy, no Redis."""

from __future__ import annotations

from dataclasses import dataclass

from skyline.scheduler.adapters import AdapterPolicy, choose, load_ms, load_wait_ms, lora_workers
from skyline.scheduler.prefix import PlacedInFlight


@dataclass
class W:
    worker_id: str
    adapters: str = ""
    role: str = "decode"
    running: int = 0
    max_running: int = 8
    kv_usage: float = 0.0
    kv_watermark: float = 0.0
    lora_slots: int = 2
    adapter_load_ms: float = 0.0

    def held_adapters(self) -> frozenset[str]:
        return frozenset(a for a in self.adapters.split(",") if a)


P = AdapterPolicy(slack_share=0.5, max_wait_ms=2000, default_load_ms=300.0)


def test_waits_for_the_engine_holding_the_adapter_for_a_share_of_its_slack():
    ws = [W("a"), W("b", adapters="sql,chat"), W("c", adapters="chat")]
    c = choose(P, "sql", ws, now_ms=10_000, deadline_ms=11_000)
    assert c is not None and c.worker == "b"
    assert c.until_ms == 10_000 + 500  # half the 1 s slack (longer than the 300 ms load)


def test_the_wait_covers_a_load_elsewhere_but_never_the_slack_or_the_cap():
    ws = [W("a", adapter_load_ms=800.0), W("b", adapters="sql", adapter_load_ms=600.0)]
    assert load_ms(P, ws) == 700.0
    c = choose(P, "sql", ws, 0, 1_000)
    assert c is not None and c.until_ms == 700  # the load (700) is longer than half the slack (500)
    c = choose(P, "sql", ws, 0, 300)
    assert c is not None and c.until_ms == 300  # never past the slack
    c = choose(P, "sql", ws, 0, 60_000)
    assert c is not None and c.until_ms == 2000  # never past max_wait_ms
    c = choose(P, "sql", ws, 5_000, 4_000)  # already late: free for anyone at once
    assert c is not None and c.until_ms == 5_000


def test_least_loaded_holder_wins_and_placed_requests_count():
    ws = [W("a", adapters="sql", running=3), W("b", adapters="sql", running=1)]
    assert choose(P, "sql", ws, 0, 1000).worker == "b"
    placed = PlacedInFlight()
    for i in range(4):
        placed.add(f"r{i}", "b")
    assert choose(P, "sql", ws, 0, 1000, placed.count).worker == "a"


def test_no_holder_a_full_holder_or_one_worker_goes_to_the_shared_queue():
    assert choose(P, "sql", [W("a"), W("b", adapters="chat")], 0, 1000) is None
    full = W("b", adapters="sql", running=8)
    assert choose(P, "sql", [W("a"), full], 0, 1000) is None
    nearly_out_of_kv = W("b", adapters="sql", kv_usage=0.97)
    assert choose(P, "sql", [W("a"), nearly_out_of_kv], 0, 1000) is None
    assert choose(P, "sql", [W("b", adapters="sql")], 0, 1000) is None
    assert choose(P, None, [W("a", adapters="sql"), W("b")], 0, 1000) is None
    assert choose(AdapterPolicy(enabled=False), "sql", [W("a", adapters="sql"), W("b")], 0, 1000) is None


def test_only_workers_of_the_stage_that_run_lora_are_candidates():
    ws = [W("p", role="prefill", adapters="sql"), W("d", adapters=""), W("e", role="elastic", adapters="sql"),
          W("off", lora_slots=0)]
    assert [w.worker_id for w in lora_workers(ws, "decode")] == ["d", "e"]
    assert [w.worker_id for w in lora_workers(ws, "prefill")] == ["p", "e"]
    assert choose(P, "sql", lora_workers(ws, "decode"), 0, 1000).worker == "e"


def test_admission_adds_one_load_when_no_engine_of_the_stage_holds_the_adapter():
    ws = [W("a", adapters="chat"), W("b")]
    assert load_wait_ms(P, "sql", ws) == 300.0  # nobody measured yet: the default
    ws[1].adapter_load_ms = 120.0
    assert load_wait_ms(P, "sql", ws) == 120.0
    assert load_wait_ms(P, "chat", ws) == 0.0
    assert load_wait_ms(P, None, ws) == 0.0
