"""Shared fixtures: one real redis-server per test session, isolated per test by key prefix."""

from __future__ import annotations

import sys
import uuid

import pytest

from skyline.tools.redis_server import start_redis

from skyline.core.net import free_port


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server process (never a mock) on a free loopback port."""
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def key_prefix() -> str:
    """A fresh key prefix per test, so tests sharing the server never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran against a process fleet shows the end of the fleet's logs:
    on a CI machine they are gone with the run, and they say why a request failed."""
    report = yield
    fleet = getattr(item, "funcargs", {}).get("fleet")
    if report.when == "call" and report.failed and hasattr(fleet, "all_logs"):
        report.sections.append(("fleet logs (tails)", fleet.all_logs()))
    return report


@pytest.fixture(autouse=True)
def _no_skyline_up_outlives_its_test():
    """A test that starts `skyline up` (tests/test_skyline_up.py Terminal) and fails before stopping it
    leaves no fleet behind."""
    yield
    up = sys.modules.get("tests.test_skyline_up")
    if up is not None:
        up.Terminal.kill_leftovers()
