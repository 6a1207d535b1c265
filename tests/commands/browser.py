"""Headless Chromium driven through the DevTools protocol over a pipe (`--remote-debugging-pipe`).

No Python dependency and no browser download: Chromium reads NUL-terminated JSON commands on fd 3 and
answers on fd 4. Enough protocol for the report's test: open a page at a given window width, evaluate
JavaScript, take screenshots of regions.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    def __init__(self, executable: str, profile: Path, timeout: float = 60.0) -> None:
        to_child, from_parent = os.pipe()  # fd 3 of the child: commands
        from_child, to_parent = os.pipe()  # fd 4 of the child: replies and events
        self.timeout = timeout

        def fds() -> None:  # in the child: put the pipe ends at 3 and 4
            os.dup2(to_child, 3)
            os.dup2(to_parent, 4)

        self.process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4, to_child, to_parent),  # 3 and 4 are closed after preexec_fn unless kept
            preexec_fn=fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(to_parent)
        self._out = os.fdopen(from_parent, "wb", buffering=0)
        self._in = os.fdopen(from_child, "rb", buffering=0)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close", session=False)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._out.close()
        self._in.close()

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = self._in.read(1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: bool = True, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session and self.session:
            message["sessionId"] = self.session
        self._out.write(json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)
        raise TimeoutError(method)

    def wait_event(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return self.events.pop(i)
        while time.monotonic() < deadline:
            event = self._read_message()
            if event.get("method") == method:
                return event
            self.events.append(event)
        raise TimeoutError(method)

    def open(self, url: str, width: int, height: int) -> None:
        target = self.call("Target.createTarget", session=False, url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", session=False, targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, clip: dict[str, float]) -> Path:
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip={**clip, "scale": 1})
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
