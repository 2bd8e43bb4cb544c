"""Headless Chromium driven over the Chrome DevTools Protocol: enough for the dashboard test.

No browser-driver package: Chromium is started with `--remote-debugging-port=0`,
writes the port it chose to `DevToolsActivePort` in its profile folder, and
the test talks JSON over one WebSocket (the `websockets` package uvicorn
already brings). Console messages and uncaught exceptions are collected so a
test can assert the page logged no error.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


class Browser:
    """`async with Browser(profile_dir) as page:` -> a `Page` on about:blank."""

    def __init__(self, profile_dir: Path, width: int = 1400, height: int = 1500):
        self.profile_dir = profile_dir
        self.size = (width, height)
        self.proc: subprocess.Popen | None = None
        self.page: Page | None = None

    async def __aenter__(self) -> Page:
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.profile_dir / "chromium.log", "wb")
        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={self.profile_dir}", f"--window-size={self.size[0]},{self.size[1]}",
             "about:blank"], stdout=log, stderr=subprocess.STDOUT)
        port = await asyncio.to_thread(self._devtools_port, 30.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as resp:
            targets = json.loads(resp.read())
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
        self.page = Page(await connect(ws_url, max_size=None))
        await self.page.start()
        return self.page

    def _devtools_port(self, timeout_s: float) -> int:
        marker = self.profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited ({self.proc.returncode}): "
                                   f"{(self.profile_dir / 'chromium.log').read_text(errors='replace')[-2000:]}")
            if marker.exists() and (text := marker.read_text().strip()):
                return int(text.splitlines()[0])
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    async def __aexit__(self, *_exc: object) -> None:
        if self.page is not None:
            await self.page.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Page:
    def __init__(self, ws: Any):
        self.ws = ws
        self.next_id = 0
        self.waiting: dict[int, asyncio.Future] = {}
        self.console: list[dict] = []  # {"level", "text"} of every console message
        self.errors: list[str] = []  # uncaught exceptions, console.error, failed loads
        self.reader: asyncio.Task | None = None

    async def start(self) -> None:
        self.reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self.call(f"{domain}.enable")

    async def close(self) -> None:
        await self.ws.close()
        if self.reader:
            self.reader.cancel()

    async def call(self, method: str, **params: Any) -> dict:
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = fut
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, 30)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return msg.get("result", {})

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg and msg["id"] in self.waiting:
                self.waiting.pop(msg["id"]).set_result(msg)
                continue
            method, p = msg.get("method"), msg.get("params", {})
            if method == "Runtime.consoleAPICalled":
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                self.console.append({"level": p.get("type"), "text": text})
                if p.get("type") in ("error", "assert"):
                    self.errors.append(f"console.{p['type']}: {text}")
            elif method == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                self.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                e = p["entry"]
                self.errors.append(f"log: {e.get('text')} {e.get('url', '')}")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def eval(self, expression: str) -> Any:
        res = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"evaluate failed: {res['exceptionDetails']}")
        return res.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = await self.eval(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied: {expression}; errors: {self.errors}")
            await asyncio.sleep(0.2)

    async def screenshot(self, path: Path) -> Path:
        res = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(res["data"]))
        return path
