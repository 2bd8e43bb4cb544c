"""`skyline up` as a user runs it: the whole fleet on this machine, stopped by Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from skyline.core.net import free_port
from skyline.tools.progress import Console, LineFilter, Seen


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


class Terminal:
    """What `skyline up` prints, read as it comes (stdout is a pipe here: no spinner, whole lines)."""

    started: list[Terminal] = []  # every one started, so that none outlives its test (kill_leftovers)

    def __init__(self, args: list[str], home: Path, **env: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skyline.cli", "up", "--engine", "sim", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,  # as in a terminal
            env=dict(os.environ, SKYLINE_HOME=str(home), PYTHONUNBUFFERED="1", **env),
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read)
        self.reader.start()
        Terminal.started.append(self)

    @classmethod
    def kill_leftovers(cls) -> None:
        """SIGKILL the process group of every `skyline up` still running: a test that failed or timed out
        before its Ctrl-C left a whole fleet behind (its own session, parent 1), on the cores of every
        later test."""
        for term in cls.started:
            if term.proc.poll() is None:
                try:
                    os.killpg(term.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                term.proc.wait(timeout=30)
        cls.started.clear()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 60) -> int:
        """Index of the first line containing `text` (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, line in enumerate(list(self.lines)):
                if text in line:
                    return i
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not printed; got:\n" + "".join(self.lines)[-3000:])

    def ctrl_c(self) -> int:
        os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the terminal's foreground group
        rc = self.proc.wait(timeout=120)
        self.reader.join(timeout=10)
        return rc


PROCESSES = ["redis", "gateway", "prefill-0", "prefill-1", "decode-0", "decode-1", "batch"]


def test_up_starts_n_plus_m_sim_workers_and_ctrl_c_stops_everything(tmp_path):
    gw_port, redis_port = free_port(), free_port()
    (tmp_path / "keys.txt").write_text(API_KEY + "\n")
    # A short drain bound: a worker whose stop hangs ends itself (its watchdog logs where) well within ctrl_c's wait.
    (tmp_path / "cfg.toml").write_text(f'[gateway]\napi_key_file = "{tmp_path / "keys.txt"}"\n'
                                       '[worker]\ndrain_timeout_s = 5.0\n')
    term = Terminal(["--prefill", "2", "--decode", "2", "--port", str(gw_port), "--redis-port", str(redis_port),
                     "--metrics-port-base", "0", "--config", str(tmp_path / "cfg.toml")], tmp_path)
    try:
        end = term.wait_for("Ctrl-C stops everything")
        banner = term.lines[:end + 1]
        text = "".join(banner)
        assert "Skyline is up" in text, text[-3000:]
        # Before the banner: a short progress report, one "starting" and one "ready" line per
        # process, no start-up chatter (the INFO lines are in the log files), no spinner redraws.
        before = term.lines[:term.wait_for("Skyline is up")]
        assert len(before) < 40, "".join(before)
        assert not any(" INFO " in line for line in before), "".join(before)
        assert "\r" not in text
        for name in PROCESSES:
            ready = [line for line in before if re.match(rf"\s*{name} \| ready", line)]
            assert len(ready) == 1, (name, "".join(before))
            if name != "redis":
                assert sum(bool(re.match(rf"\s*{name} \| starting, pid \d+", line)) for line in before) == 1
        logs = tmp_path / "logs"
        assert f"{logs}/" in text  # the banner says where the logs are
        assert f"http://127.0.0.1:{gw_port}" in text and f"redis://127.0.0.1:{redis_port}/0" in text
        assert "curl " in text and '"model": "skyline-sim"' in text
        with urllib.request.urlopen(f"http://127.0.0.1:{gw_port}/health", timeout=5) as resp:
            assert json.loads(resp.read())["workers"] == {"prefill": 2, "decode": 2}
        body = json.dumps({"model": "skyline-sim", "prompt": "hi", "max_tokens": 5}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{gw_port}/v1/completions", body,
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 5
            rid = resp.headers["x-skyline-request-id"]
        # The fleet's request log reaches the terminal after the banner: the request events of
        # every process that handled it (logger skyline.events), by the request's id.
        term.wait_for(f"skyline.events: responded request_id={rid}", timeout_s=10)
        assert any(re.match(r"\s*decode-\d \| .* skyline.events: finished ", line) for line in term.lines[end:])
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
        # Keys on and no operator key configured: `up` made one (the batch runner runs every tenant's
        # batches with it), kept beside the password and as far from command lines.
        operator = (tmp_path / "operator.key").read_text().strip()
        assert operator.startswith("sk-operator-") and not any(operator in c for c in _cmdlines())
        for key, status in ((operator, 200), (API_KEY, 403)):
            data = urllib.request.Request(f"http://127.0.0.1:{gw_port}/dashboard/data",
                                          headers={"Authorization": f"Bearer {key}"})
            try:
                with urllib.request.urlopen(data, timeout=10) as resp:
                    assert resp.status == status
            except urllib.error.HTTPError as exc:
                assert exc.code == status
        # A worker that dies while the fleet runs is started again (live workers took its requests over).
        pid = next(m.group(1) for line in before if (m := re.match(r"\s*decode-1 \| starting, pid (\d+)", line)))
        os.kill(int(pid), signal.SIGKILL)
        k = term.wait_for("skyline up: restarting decode-1 (exit -9; 1 of at most 5", timeout_s=10)
        deadline = time.monotonic() + 60
        while not (new := [m.group(1) for line in list(term.lines)[k:]
                           if (m := re.match(r"\s*decode-1 \| starting, pid (\d+)", line))]):
            assert time.monotonic() < deadline, "".join(term.lines[k:])
            time.sleep(0.1)
        while not re.search(rf"worker decode-\S+-{new[0]} ready", (logs / "decode-1.log").read_text()):
            assert time.monotonic() < deadline, (logs / "decode-1.log").read_text()[-2000:]
            time.sleep(0.2)
        req = urllib.request.Request(f"http://127.0.0.1:{gw_port}/v1/completions", body,
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 5
    finally:
        rc = term.ctrl_c()
    assert rc == 0
    # Redis is stopped last, after the workers and the gateway drained: none of them lost it on the way out
    # (each process's whole output is in its log file, its start-up and its shutdown included).
    shutdown = "".join(term.lines[end:]) + "".join((logs / f"{n}.log").read_text() for n in PROCESSES)
    assert "Connection refused" not in shutdown and "lost Redis" not in shutdown, shutdown[-3000:]
    assert "did not stop within" not in shutdown, shutdown[-6000:]  # neither killed nor ended by its watchdog
    assert not _port_open(gw_port) and not _port_open(redis_port), "something `up` started is still running"
    assert "INFO skyline.gateway: gateway serving" in (logs / "gateway.log").read_text()
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        worker_log = (logs / f"{name}.log").read_text()
        assert re.search(r"INFO skyline.worker: worker \S+ ready", worker_log), worker_log[-2000:]
        assert re.search(r"INFO skyline.worker: worker \S+ stopping \(SIGTERM\)", worker_log), worker_log[-2000:]
        assert re.search(r"INFO skyline.worker: worker \S+ stopped", worker_log), worker_log[-2000:]
    assert "INFO skyline.batch: batch runner" in (logs / "batch.log").read_text()
    assert (logs / "redis.log").stat().st_size > 0


def test_up_verbose_relays_every_line_and_a_failed_start_shows_its_log(tmp_path):
    # --verbose: today's terminal, every line of every process with its name.
    term = Terminal(["--verbose", "--port", str(free_port()), "--redis-port", str(free_port()),
                     "--metrics-port-base", "0"], tmp_path)
    try:
        banner = term.wait_for("Skyline is up")
        before = "".join(term.lines[:banner])
        assert re.search(r"gateway \| .* INFO skyline.gateway: gateway serving", before), before[-3000:]
        assert re.search(r"elastic-1 \| .* INFO skyline.worker: worker \S+ ready", before), before[-3000:]
        assert "elastic-1 | ready: /health counts 2 of 2 elastic workers" in before
    finally:
        assert term.ctrl_c() == 0
    # A process that dies while starting: its last lines and its log's path on the terminal, the fleet stopped.
    term = Terminal(["--port", str(free_port()), "--redis-port", str(free_port()), "--metrics-port-base", "0"],
                    tmp_path, SKYLINE_ADVERTISE_HOST="0.0.0.0")  # workers refuse a bind-all address at start
    assert term.proc.wait(timeout=180) == 1  # a loaded host: the imports alone can take a minute
    term.reader.join(timeout=10)
    out = "".join(term.lines)
    assert "Skyline is up" not in out
    assert re.search(rf"elastic-[01] exited with code 1; its log: {tmp_path}/logs/elastic-[01].log",
                     out), out
    assert re.search(r"elastic-[01] \| skyline worker: worker.advertise_host = '0.0.0.0' is a bind-all", out)
    assert "skyline up: stopping the fleet" in out and "Traceback" not in out
    # The earlier start's logs were kept, one generation.
    assert "INFO skyline.gateway: gateway serving" in (tmp_path / "logs" / "gateway.log.1").read_text()


def test_quiet_terminal_keeps_warnings_tracebacks_and_the_request_log():
    vllm = "(EngineCore_DP0 pid=7) {} 01-02 03:04:05 [core.py:93] {}"
    keep = LineFilter()
    assert not keep.show(vllm.format("INFO", "Initializing a V1 LLM engine"), fleet_up=False)
    assert keep.show(vllm.format("WARNING", "Not enough KV cache blocks"), fleet_up=False)
    assert keep.show(vllm.format("ERROR", "EngineCore failed to start."), fleet_up=False)
    assert not keep.show("2026-01-02 03:04:05,678 INFO skyline.worker: worker d-1 ready", fleet_up=False)
    assert keep.show("2026-01-02 03:04:05,678 INFO skyline.events: arrived request_id=r1", fleet_up=True)
    assert not keep.show("2026-01-02 03:04:05,678 INFO uvicorn.error: Started server", fleet_up=True)
    assert not keep.show(vllm.format("INFO", "Avg prompt throughput: 1.0 tokens/s"), fleet_up=True)
    assert keep.show('{"ts": "t", "level": "INFO", "logger": "skyline.events", "event": "finished"}', fleet_up=True)
    traceback = ["Traceback (most recent call last):", '  File "w.py", line 3, in main', "    run()",
                 "OSError: [Errno 98] Address already in use"]
    assert all(keep.show(line, fleet_up=False) for line in traceback)
    assert not keep.show("Loading weights: 100%", fleet_up=False)  # the traceback ended with its exception line
    # vLLM repeats its start-up warnings in every engine process: the terminal shows each once until the banner.
    seen = Seen()
    prefill, decode = LineFilter(seen), LineFilter(seen)
    triton = "2026-01-02 03:04:05,678 WARNING vllm.platforms.cpu: Triton is not installed."
    assert prefill.show(triton, fleet_up=False)
    assert not decode.show(vllm.format("WARNING", "Triton is not installed."), fleet_up=False)
    assert decode.show(vllm.format("ERROR", "EngineCore failed to start."), fleet_up=False)  # errors: every one
    assert decode.show(triton, fleet_up=True)
    # Warnings every CPU start prints that ask nothing of the operator stay in the log files until the banner.
    eager = vllm.format("WARNING", "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup.")
    assert not LineFilter(Seen()).show(eager, fleet_up=False)
    assert LineFilter(Seen()).show(eager, fleet_up=True)


def test_spinner_only_on_a_terminal():
    import io

    pipe, tty = io.StringIO(), io.StringIO()
    for out, live in ((pipe, False), (tty, True)):
        console = Console(out, live=live)
        console.spin("waiting for decode-0")
        console.line("  decode-0 | ready")
        console.done()
    assert pipe.getvalue() == "  decode-0 | ready\n"  # a pipe (CI, a log of the terminal) gets whole lines only
    assert "waiting for decode-0" in tty.getvalue() and tty.getvalue().endswith("\r\x1b[K")


def test_no_process_of_the_fleet_outlives_a_launcher_killed_with_sigkill(tmp_path):
    # `skyline up` killed by SIGKILL cannot stop anything: each process it started ends by itself
    # (the kernel's parent-death signal, skyline/core/lifetime.py): workers drain as on SIGTERM.
    from tests.procs import descendants, wait_gone

    gw_port, redis_port = free_port(), free_port()
    term = Terminal(["--port", str(gw_port), "--redis-port", str(redis_port), "--metrics-port-base", "0"], tmp_path)
    term.wait_for("Ctrl-C stops everything")
    fleet = descendants(term.proc.pid)
    assert len(fleet) >= 5, fleet  # redis, gateway, prefill, decode, batch runner
    os.kill(term.proc.pid, signal.SIGKILL)
    term.proc.wait()
    left = wait_gone(fleet, timeout_s=30)
    assert not left, [open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in left]
    assert not _port_open(gw_port) and not _port_open(redis_port)


def test_nixl_side_channels_get_ports_no_outgoing_connection_can_take():
    """An engine binds its NIXL side channel only after loading its model; a port the OS handed out as
    free (the ephemeral range) was taken by another process's outgoing connection in between (CI,
    2026-12-07: "Address already in use"). Listen ports come from below that range, disjoint per engine."""
    from skyline.core.config import SkylineConfig
    from skyline.core.net import ephemeral_low, listen_ports
    from skyline.tools.launcher import plan_workers

    class Draws:  # randint's draws in order, as a seeded random.Random would give them
        def __init__(self, *values: int):
            self.values = list(values)

        def randint(self, _lo: int, _hi: int) -> int:
            return self.values.pop(0)

    with socket.socket() as held:
        held.bind(("127.0.0.1", listen_ports()[0]))
        held.listen()
        port = held.getsockname()[1]
        # A draw on the held port, one whose second rank would be the held port, one overlapping the
        # first pick, then free ones: only free, disjoint runs come back.
        free = listen_ports(2, span=2)
        got = listen_ports(2, span=2, rng=Draws(port, port - 1, free[0], free[0] + 1, free[1]))
    assert got == free, (got, free, port)
    for _ in range(20):
        bases = listen_ports(4, span=3)
        assert all(10000 <= b and b + 3 <= ephemeral_low() for b in bases), bases
        assert all(abs(a - b) >= 3 for i, a in enumerate(bases) for b in bases[i + 1:]), bases
    plan = plan_workers(SkylineConfig(), 2, 2)
    nixl = [int(args[args.index("--nixl-port") + 1]) for _name, args in plan]
    assert len(set(nixl)) == 4 and all(p < ephemeral_low() for p in nixl), nixl


def test_engines_get_cores_of_their_own_pool():
    from skyline.tools.launcher import core_binds

    assert core_binds(0, 1, [0, 1]) == ["0-1"]  # a lone engine: every core
    assert core_binds(1, 1, [0, 1]) == ["0", "1"]
    assert core_binds(2, 2, [0, 1, 2, 3]) == ["0", "1", "2", "3"]
    assert core_binds(0, 3, [0, 1]) == ["0", "1", "0"]  # colocated: round-robin
    # More engines than cores: no decode engine on a prefill engine's core.
    assert core_binds(1, 2, [0, 1]) == ["0", "1", "1"]
    assert core_binds(2, 2, [0, 1]) == ["0", "0", "1", "1"]
    assert core_binds(1, 3, [4, 5, 6]) == ["4", "5", "6", "5"]
    assert core_binds(3, 1, [0, 1, 2]) == ["0", "1", "0", "2"]
    assert core_binds(1, 1, [7]) == ["7", "7"]  # one core: nothing to separate
    # Engines of several ranks (tensor/pipeline parallel: vLLM's CPU backend runs a process per rank): a core
    # set per rank, joined with | (VLLM_CPU_OMP_THREADS_BIND), each rank placed as an engine of its own.
    assert core_binds(0, 1, [0, 1], [2]) == ["0|1"]
    assert core_binds(0, 1, [0, 1, 2, 3], [2]) == ["0-1|2-3"]
    assert core_binds(0, 1, [0], [2]) == ["0|0"]
    assert core_binds(1, 1, [0, 1, 2], [1, 2]) == ["0", "1|2"]
    assert core_binds(0, 2, [0, 1], [2, 2]) == ["0|1", "0|1"]


def test_a_taken_port_is_named_with_its_holder_before_anything_starts(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        redis_port = free_port()
        t0 = time.monotonic()
        term = Terminal(["--port", str(port), "--redis-port", str(redis_port), "--metrics-port-base", "0"], tmp_path)
        assert term.proc.wait(timeout=180) == 1  # a loaded host: the imports alone can take a minute
        term.reader.join(timeout=10)
        took = time.monotonic() - t0
    out = "".join(term.lines)
    assert f"port {port} (the gateway) is taken by pid {os.getpid()}" in out, out
    assert "nothing was started" in out and "Traceback" not in out
    assert "starting, pid" not in out and not _port_open(redis_port)  # no Redis, gateway or worker was started
    assert took < 30, took  # found before any engine could have started (tens of seconds on a real one)
