"""The live dashboard in headless Chromium against a running sim fleet (gateway + workers as processes).

Charts must render with data, tables fill, a slow request's timeline draws as
a waterfall, and the page logs no console error. The screenshot is kept in
the test's tmp dir (and in $SKYLINE_TEST_ARTIFACTS when set).
"""

import json
import shutil
import threading
from pathlib import Path

import pytest

from skyline.core import envs
from tests.cdp import CHROMIUM, Browser
from tests.fleet import Fleet

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"{CHROMIUM} missing: `make chromium` installs Debian's chromium package")

CHARTS = ("chart-queue", "chart-attainment", "chart-ttft", "chart-tpot")


def send_traffic(fleet: Fleet, n: int, done: threading.Event) -> None:
    client = fleet.client(timeout_s=30)
    for i in range(n):
        tier = ("interactive", "standard", "batch")[i % 3]
        headers = {"x-slo-tier": tier, **({"x-slo-tpot-ms": "1"} if i % 4 == 0 else {})}  # some miss their SLO
        client.completions.create(model="skyline-sim", prompt=f"request {i} " * (5 + 20 * (i % 5)), max_tokens=16,
                                  extra_headers=headers)
    done.set()


async def test_dashboard_renders_live_charts_tables_and_a_timeline(redis_url, key_prefix, tmp_path):
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--log-format", "json"])
    with fleet.running({"prefill-0": ("prefill",), "decode-0": ("decode",)}, timeout_s=60):
        done = threading.Event()
        threading.Thread(target=send_traffic, args=(fleet, 24, done), daemon=True).start()
        assert await _wait(done, 60), "traffic did not finish"
        async with Browser(tmp_path / "chromium-profile") as page:
            await page.goto(f"{fleet.url}/dashboard")
            await page.wait_for("window.dashboardState && window.dashboardState.polls >= 2")
            for chart in CHARTS:
                points = await page.wait_for(f"Number(document.getElementById('{chart}').dataset.points || 0)")
                assert points > 0, chart
            rows = await page.eval("[...document.querySelectorAll('#workers tr')].slice(1)"
                                   ".map(r => r.cells[1].textContent)")
            assert sorted(rows) == ["decode", "prefill"]
            kpi = await page.eval("document.querySelector('#kpis .kpi span').textContent")
            assert "of 24 met" in kpi
            links = await page.eval("[...document.querySelectorAll('#slowest a.trace')].map(a => a.dataset.id)")
            assert len(links) == 10
            await page.eval("document.querySelector('#slowest a.trace').click()")
            spans = await page.wait_for("document.querySelectorAll('#timeline svg rect.span').length")
            events = await page.eval(f"fetch('/v1/requests/{links[0]}/timeline').then(r => r.json())"
                                     ".then(d => d.events.length)")
            assert spans == events >= 10
            assert "time to first token" in await page.eval("document.getElementById('timeline').textContent")
            state = await page.eval("window.dashboardState")
            shot = await page.screenshot(tmp_path / "dashboard.png")
            assert state["errors"] == 0, state["lastError"]
            assert page.errors == [], page.errors
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
    check_json_logs(tmp_path)
    if envs.TEST_ARTIFACTS.is_set():
        out = Path(envs.TEST_ARTIFACTS.get())
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / "dashboard.png")


async def test_with_api_keys_the_page_asks_for_an_operator_key_and_then_renders(redis_url, key_prefix, tmp_path):
    # No workers needed: what is checked is who may read /dashboard/data (gateway/dashboard.py).
    tenant, operator = "sk-dash-tenant-" + key_prefix, "sk-dash-operator-" + key_prefix
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path,
                  gateway_args=("--api-key", tenant, "--operator-api-key", operator))
    with fleet.running({}, timeout_s=60):
        async with Browser(tmp_path / "chromium-profile") as page:
            await page.goto(f"{fleet.url}/dashboard")  # the page itself needs no key: it holds no data
            await page.wait_for("window.dashboardState && window.dashboardState.needsKey")
            assert await page.eval("document.getElementById('key-form').hidden") is False
            assert await page.eval("window.dashboardState.polls") == 0

            async def enter(key: str) -> None:
                await page.eval(f"document.getElementById('key-input').value = {json.dumps(key)};"
                                "document.getElementById('key-form').requestSubmit()")

            await enter(tenant)  # a valid key, but a tenant's: the fleet's traffic is not for it
            await page.wait_for("window.dashboardState.needsKey && "
                                "document.getElementById('key-why').textContent.includes('operator key')")
            assert await page.eval("window.dashboardState.polls") == 0
            assert await page.eval("sessionStorage.getItem('skyline-api-key')") is None  # a refused key is dropped

            await enter(operator)
            await page.wait_for("window.dashboardState.polls >= 2")
            state = await page.eval("window.dashboardState")
            assert state["errors"] == 0 and not state["needsKey"], state["lastError"]
            assert await page.eval("document.getElementById('key-form').hidden") is True
            assert "no live workers" in await page.eval("document.getElementById('workers').textContent")
            assert await page.eval("location.search") == ""  # the key never went into the URL
            # The only errors: the browser's own lines for the refused data fetches (401, then 403).
            refused = [e for e in page.errors if "dashboard/data" in e and ("401" in e or "403" in e)]
            assert refused and refused == page.errors, page.errors


def check_json_logs(log_dir: Path) -> None:
    """--log-format json: every line an object; one per request event, with request id and worker."""
    seen = {}
    for name in ("gateway", "prefill-0", "decode-0"):
        for line in (log_dir / f"{name}.log").read_text().splitlines():
            record = json.loads(line)
            assert {"ts", "level", "logger"} <= set(record), line
            if "event" in record:
                assert record["request_id"] and record["worker"], line
                seen.setdefault(record["event"], set()).add(record["worker"])
    assert any(w.startswith("gateway-") for w in seen["arrived"]) and seen["prefill_claimed"] == {"prefill-0"}
    assert seen["first_token"] == {"decode-0"} and len(seen["responded"]) == 1


async def _wait(event: threading.Event, timeout_s: float) -> bool:
    import asyncio

    return await asyncio.to_thread(event.wait, timeout_s)
