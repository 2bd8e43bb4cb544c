"""`skyline up` as a user runs it: the whole fleet on this machine, stopped by Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from skyline.redis_server import free_port


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


API_KEY = "sk-up-test-0123456789"


def _cmdlines() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return out


def test_up_starts_n_plus_m_sim_workers_and_ctrl_c_stops_everything(tmp_path):
    gw_port, redis_port = free_port(), free_port()
    (tmp_path / "keys.txt").write_text(API_KEY + "\n")
    (tmp_path / "cfg.toml").write_text(f'[gateway]\napi_key_file = "{tmp_path / "keys.txt"}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyline.cli", "up", "--engine", "sim", "--prefill", "2", "--decode", "2",
         "--port", str(gw_port), "--redis-port", str(redis_port), "--metrics-port-base", "0",
         "--config", str(tmp_path / "cfg.toml")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,  # as in a terminal
        env=dict(os.environ, SKYLINE_HOME=str(tmp_path), PYTHONUNBUFFERED="1"),
    )
    banner = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            banner.append(line)
            if "Ctrl-C stops everything" in line:
                break
        text = "".join(banner)
        assert "Skyline is up" in text, text[-3000:]
        assert f"http://127.0.0.1:{gw_port}" in text and f"redis://127.0.0.1:{redis_port}/0" in text
        assert "curl " in text and '"model": "skyline-sim"' in text
        with urllib.request.urlopen(f"http://127.0.0.1:{gw_port}/health", timeout=5) as resp:
            assert json.loads(resp.read())["workers"] == {"prefill": 2, "decode": 2}
        body = json.dumps({"model": "skyline-sim", "prompt": "hi", "max_tokens": 5}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{gw_port}/v1/completions", body,
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 5
        anonymous = urllib.request.Request(f"http://127.0.0.1:{gw_port}/v1/completions", body,
                                           {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(anonymous, timeout=10)
            raise AssertionError("a request without the API key was served")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        # Secrets stay off command lines (`ps` shows those to every user of the machine).
        assert not any(API_KEY in c for c in _cmdlines())
        password = (tmp_path / "redis-fleet.password").read_text().strip()
        assert password and not any(password in c for c in _cmdlines())
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the terminal's foreground group
        rc = proc.wait(timeout=60)
    assert rc == 0
    # Redis is stopped last, after the workers and the gateway drained: none of them lost it on the way out.
    shutdown = proc.stdout.read()
    assert "Connection refused" not in shutdown and "lost Redis" not in shutdown, shutdown[-3000:]
    assert not _port_open(gw_port) and not _port_open(redis_port), "something `up` started is still running"
