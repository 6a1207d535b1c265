"""A served tiny model: `llmplan serve`'s app on a free loopback port, in a thread, for the real clients."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmplan.commands.serve.app import ServerSettings, ThreadedServer, create_app, uvicorn_config
from llmplan.commands.serve.command import build_host
from tests.stages.tiny_run import load_stages, make_tiny_model_dir

MAX_NEW = 40


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_serve_plan(
    tmp: Path,
    model_dir: Path,
    *,
    slots: int = 4,
    context: int = 128,
    name: str = "tiny-serve",
    cache_db: Path | None = None,
    **generate: Any,
) -> Path:
    plan = {
        "name": name,
        "device": "cpu",
        "seed": 0,
        "threads": 1,
        "stages": [
            *load_stages(model_dir, place={"max_batch": slots, "kv_cache": {"max_tokens": context}}),
            {"id": "prompt", "uses": "compute.tokenize", "with": {"messages": [{"role": "user", "content": "hi"}]}},
            {
                "id": "generate",
                "uses": "compute.generate",
                # greedy for served requests too (they take the API's defaults but where the plan marks its own)
                "with": {"max_new_tokens": MAX_NEW, "temperature": 0, "serving_defaults": ["temperature"], **generate},
            },
            {"id": "clean", "uses": "output.postprocess"},
            {"id": "text", "uses": "output.detokenize"},
            {"id": "write", "uses": "output.write", "with": {"to": ["terminal"]}},
            {"id": "release", "uses": "output.release"},
        ],
    }
    if cache_db is not None:
        plan["stages"] += [
            {"id": "lookup", "uses": "cache.lookup", "with": {"db": str(cache_db), "mode": "reuse"}},
            {"id": "store", "uses": "output.cache", "with": {"db": str(cache_db)}},
        ]
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def hold_after(loop: Any, steps: int) -> threading.Event:
    """From its `steps`-th step on, the engine loop's stepper waits until the returned event is set: a request
    held mid-way cannot end by itself while the test acts (disconnects, fills the queue)."""
    gate, step = threading.Event(), loop.step
    loop.step = lambda: (loop.stats.steps < steps or gate.wait(30)) and step()
    return gate


class LiveServer:
    """uvicorn in a thread of this process; `url` is the OpenAI base URL."""

    def __init__(
        self,
        plan: Path,
        settings: ServerSettings,
        overrides: list[str] | None = None,
        run_dir: Path | None = None,
        slots: int | None = None,
    ) -> None:
        run_dir = run_dir or plan.parent / f"run-{plan.stem}"
        self.host = build_host(
            str(plan), overrides or [], keep_alive_s=settings.keep_alive_s, run_dir=run_dir, slots=slots
        )
        self.host.load()
        self.app = create_app(self.host, settings)
        self.port = free_port()
        config = uvicorn_config(self.app, settings, "127.0.0.1", self.port)
        self.server = ThreadedServer(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.stop_model = threading.Event()  # the model thread is a background one here (speed is not tested)
        self.model_thread = threading.Thread(target=self.host.serve_forever, args=(self.stop_model,), daemon=True)
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"

    def __enter__(self) -> LiveServer:
        self.model_thread.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self.host.scheduler is not None:
            self.host.scheduler.cancel_all()
        self.thread.join(30)
        self.stop_model.set()
        self.model_thread.join(30)
        self.host.release_thread()
        self.host.close()
        assert not self.thread.is_alive() and not self.model_thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir, _ = make_tiny_model_dir(tmp_path_factory.mktemp("serve-model"), n_layers=2)
    return model_dir


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    plan = write_serve_plan(tmp_path_factory.mktemp("serve"), tiny_model)
    with LiveServer(plan, ServerSettings(max_queue=32)) as live:
        yield live
