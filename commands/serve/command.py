"""`llmplan serve PLAN`: keep the plan's model loaded and answer over an OpenAI-compatible HTTP API.

    llmplan serve plans/llama-int8.yaml [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--keep-alive 5m]
        [--max-queue 64] [--slots N] [--strict-model] [--open-metrics] [--no-access-log] [--set ID.PARAM=VALUE ...]

The plan decides everything, as in `run`: its resident stages load once, its request stages run per request
(so its precision, sampling defaults, filter, results cache and file sinks apply to served requests too).
SIGINT / SIGTERM: stop accepting, cancel what runs, run the release stage, exit 0.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmplan.engine.cli import CliError, add_model_option, new_context, settle_plan
from llmplan.engine.findings import StageFailure

from .slot_sizing import auto_slots

if TYPE_CHECKING:  # the model host and the plan machinery load when a server starts, not for `--help`
    from .host import ModelHost

PLACE = "load.to_device"
DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)([smh]?)$")
API_KEY = re.compile(r"[\x21-\x7e]{1,256}")


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="answer requests over an OpenAI-compatible HTTP API")
    serve.add_argument("plan", nargs="?", help="the plan (with --model and no plan: the default plan)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("LLMPLAN_API_KEY") or None, help="require this bearer key")
    serve.add_argument("--keep-alive", type=duration, default=None, help="unload after this long idle (5m, 30s)")
    serve.add_argument("--max-queue", type=int, default=64, help="requests in flight before 429")
    serve.add_argument(
        "--open-metrics", action="store_true", help="serve /metrics without the API key (it needs it by default)"
    )
    serve.add_argument(
        "--slots",
        type=slot_count,
        default="auto",
        metavar="N",
        help="requests decoded at once: the KV cache gets N rows of kv_cache.max_tokens each (`validate --deep` "
        "shows the memory). Default (auto): the plan's place.max_batch where it sets one, else as many slots as "
        "fit in a quarter of the free memory (GPU, or available RAM) at start, sized at the cache's dtype "
        "(fp32 for auto), 1 to 16",
    )
    serve.add_argument("--no-access-log", action="store_true", help="no JSON line per request on stderr")
    serve.add_argument(
        "--strict-model",
        action="store_true",
        help="refuse (404) a request naming another model; default: any name is answered by this one",
    )
    serve.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE", help="override a parameter")
    serve.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_model_option(serve)
    serve.set_defaults(handler=cmd_serve)


def slot_count(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or not 1 <= int(text) <= 4096:
        raise argparse.ArgumentTypeError(f"expected auto or a number of slots 1-4096, got {text!r}")
    return int(text)


def duration(text: str) -> float | None:
    """'5m', '30s', '1h', '90' (seconds); a negative value means never unload (Ollama's convention)."""
    match = DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a duration like 30s, 5m or 1h, got {text!r}")
    value = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]
    return None if value < 0 else value


def build_host(
    plan: str,
    overrides: list[str],
    *,
    keep_alive_s: float | None,
    quiet: bool = True,
    run_dir: Path | None = None,
    slots: int | str | None = None,
) -> ModelHost:
    """The host of `plan`; `slots`: N rows of KV cache, "auto" (sized from memory unless the plan sets
    place.max_batch: slot_sizing.py), or None (the plan's)."""
    from llmplan.engine.console import print_stage
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover
    from llmplan.engine.serving import ServeError

    from .host import ModelHost

    registry = discover()
    bound = load_plan(plan, registry, overrides)
    if slots == "auto":
        choice = auto_slots(bound)
        slots = None if choice is None else choice.slots
        if choice is not None and not quiet:
            print(f"slots: {choice.why} (--slots N to choose)", file=sys.stderr)
    if slots is not None:  # the placing stage's max_batch: its KV cache gets that many rows, one per request
        place = next((b.id for b in bound.stages if b.spec.uses == PLACE), None)
        if place is None:
            raise CliError(f"--slots: {plan} has no {PLACE} stage to size the KV cache of")
        bound = load_plan(plan, registry, [*overrides, f"{place}.max_batch={slots}"])
    try:
        return ModelHost(
            bound,
            lambda: new_context(registry, bound),
            keep_alive_s=keep_alive_s,
            report=None if quiet else print_stage,
            run_dir=run_dir,
        )
    except ServeError as bad:
        raise CliError(str(bad)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from .app import ServerSettings, ThreadedServer, create_app, uvicorn_config

    if args.max_queue < 1:
        raise CliError("--max-queue must be at least 1")
    if args.api_key is not None and not API_KEY.fullmatch(args.api_key):
        raise CliError(  # clients send it in an HTTP header: an empty key, a space or a non-ASCII one cannot work
            "--api-key (or LLMPLAN_API_KEY) must be 1-256 printable ASCII characters without spaces"
        )
    _check_port(args.host, args.port)
    settle_plan(args)
    host = build_host(args.plan, args.set, keep_alive_s=args.keep_alive, quiet=args.quiet, slots=args.slots)
    try:
        host.load()
    except StageFailure as bad:
        host.plan.close()
        raise CliError(f"loading {args.plan} failed: {bad}") from None
    settings = ServerSettings(
        api_key=args.api_key,
        max_queue=args.max_queue,
        keep_alive_s=args.keep_alive,
        strict_model=args.strict_model,
        open_metrics=args.open_metrics,
        access_log=None if args.no_access_log else sys.stderr,
    )
    app = create_app(host, settings)
    name = host.bound.plan.name
    config = uvicorn_config(app, settings, args.host, args.port, timeout_graceful_shutdown=5)
    server = ThreadedServer(config)
    http = threading.Thread(target=server.run, name="llmplan-http", daemon=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        server.should_exit = True  # stop accepting; uvicorn finishes in its thread
        if host.scheduler is not None:
            host.scheduler.cancel_all()  # what runs ends now, so its streams close
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        print(f"serving {name} on http://{args.host}:{args.port}/v1 (run directory {host.run_dir})", file=sys.stderr)
        host.serve_forever(stop)  # the main thread is the model thread (host.py says why)
        while http.is_alive():  # keep stepping while uvicorn lets its connections go
            host.pump(0.02)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        host.close()  # cancel what is left, run the release stage
    print("stopped", file=sys.stderr)
    return 0


def _check_port(host: str, port: int) -> None:
    """A taken port is one clear line before the model loads, not a uvicorn traceback after."""
    if not 0 < port < 65536:
        raise CliError(f"--port {port}: must be 1-65535")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as bad:
        raise CliError(f"{host}:{port}: cannot listen ({bad.strerror})") from None
