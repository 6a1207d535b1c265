"""`llmplan bench PLAN --serve [--vs llama-server]`: the resident server under load, beside llama.cpp's own.

Starts `llmplan serve PLAN` (as its own process, on a free loopback port) and, with `--vs llama-server`,
llama.cpp's server on the Q8_0 GGUF of the same model (`--parallel` slots, built by
benchmarks/build_llama_server.sh from the llama.cpp that llama-cpp-python's source package vendors). Then,
per level of concurrent clients, the load generator (load_generator.py: streaming chat completions, greedy,
EOS ignored, `max(2 x clients, 4)` requests, bounded in time) runs against one server and then the other,
so both see the same machine load; prompts are distinct texts of the same token count for both (one
tokenizer). Reported per side and level: requests/s, output tok/s, TTFT and inter-token latency p50/p99,
refused and lost requests; and the ratios llmplan / llama-server.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from llmplan.engine.cli import CliError, new_context
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover
from llmplan.engine.runner import Runner
from llmplan.openmp_env import foreign_env

from .load_generator import LoadSummary, build_prompts, run_load
from .measure import stage_ids

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"
LLAMA_ALIAS = "smollm2-q8_0"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CliError(f"{what} exited with status {proc.returncode} before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
    raise CliError(f"{what} was not ready after {timeout_s:g} s")


@contextlib.contextmanager
def running(cmd: list[str], what: str, url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A server process for the block's duration, ready (its /health answered); stopped (SIGTERM, then
    SIGKILL) however the block ends."""
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=foreign_env())
        try:
            wait_ready(url, proc, what)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve_overrides(plan: str, user: list[str], slots: int, context: int, max_tokens: int) -> list[str]:
    """The plan as a server under test: enough slots and tokens, no results-cache replays, no file sinks."""
    ids = stage_ids(plan, user)
    extra = []
    if "load.to_device" in ids:
        extra += [
            f"{ids['load.to_device']}.max_batch={slots}",
            f"{ids['load.to_device']}.kv_cache.max_tokens={context}",
        ]
    if "compute.generate" in ids:
        extra.append(f"{ids['compute.generate']}.max_new_tokens={max_tokens}")
    if "cache.lookup" in ids:
        extra.append(f"{ids['cache.lookup']}.mode=off")  # every request is computed, as llama-server computes it
    if "output.write" in ids:
        extra.append(f"{ids['output.write']}.to=[terminal]")
    return user + extra


def chat_token_counter(plan: str, overrides: list[str]) -> Any:
    """text -> tokens of a one-message chat prompt, with the plan's own tokenizer (loaded, no weights)."""
    registry = discover()
    bound = load_plan(plan, registry, overrides)
    ids = {s.spec.uses: s.id for s in bound.stages}
    if "load.tokenizer" not in ids:
        raise CliError(f"{plan}: no load.tokenizer stage")
    ctx = new_context(registry, bound, json_mode=True)
    with tempfile.TemporaryDirectory(prefix="llmplan-bench-") as run_dir:
        result = Runner(bound, ctx, Path(run_dir), until=ids["load.tokenizer"]).run()
    if result.exit_code:
        raise CliError(f"loading the tokenizer of {plan} failed: {result.message}")
    tok = ctx.tokenizer
    return lambda text: len(tok.encode_chat([{"role": "user", "content": text}])[1])


def llama_server_paths() -> tuple[str, str]:
    """(llama-server, the Q8_0 GGUF), built or found by the benchmark scripts of this checkout."""
    paths = []
    for script in ("build_llama_server.sh", "smollm2_q8_0.sh"):
        path = SCRIPTS / script
        if not path.is_file():
            raise CliError(f"{path}: not found (--vs llama-server runs from a checkout of llmplan)")
        done = subprocess.run(["bash", str(path)], stdout=subprocess.PIPE, text=True, check=False, env=foreign_env())
        if done.returncode or not done.stdout.strip():
            raise CliError(f"{script} failed (exit {done.returncode}); its messages are above")
        paths.append(done.stdout.strip().splitlines()[-1])
    return paths[0], paths[1]


def bench_serve(args: Any, say: Any) -> dict[str, Any]:
    levels: list[int] = args.clients
    slots = max(levels)
    context = args.prompt_tokens + args.gen_tokens + 64
    overrides = serve_overrides(args.plan, args.set, slots, context, args.gen_tokens)
    counts = [max(4, 2 * c) for c in levels]
    say("bench --serve: building prompts with the plan's tokenizer")
    prompts = build_prompts(1 + sum(counts), args.prompt_tokens, chat_token_counter(args.plan, overrides), seed=14)
    sides: dict[str, dict[str, Any]] = {}
    work = Path(tempfile.mkdtemp(prefix="llmplan-bench-serve-"))
    ours_port = free_port()
    ours_url = f"http://127.0.0.1:{ours_port}"
    ours = [sys.executable, "-m", "llmplan", "serve", args.plan, "--port", str(ours_port), "--quiet"]
    ours += [a for o in overrides for a in ("--set", o)]
    ours += ["--max-queue", str(max(64, 4 * slots))]
    servers: list[tuple[str, list[str], str, str]] = [("llmplan", ours, ours_url, "")]
    if args.vs == "llama-server":
        binary, gguf = llama_server_paths()
        port = free_port()
        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots)]
        cmd += ["-c", str(max(context, 512) * slots), "-t", str(args.threads), "--alias", LLAMA_ALIAS]
        servers.append(("llama-server", cmd, f"http://127.0.0.1:{port}", LLAMA_ALIAS))
    with contextlib.ExitStack() as stack:
        for name, cmd, url, _ in servers:
            say(f"bench --serve: starting {name}")
            stack.enter_context(running(cmd, name, url, work / f"{name}.log"))
        model = _served_model(ours_url)
        for _name, _, url, alias in servers:  # one warm-up request each (first-use costs are not serving speed)
            run_load(url, alias or model, prompts[:1], max_tokens=args.gen_tokens, requests=1)
        start = 1
        for clients, n in zip(levels, counts, strict=True):
            batch = prompts[start : start + n]
            start += n
            for name, _, url, alias in servers:
                say(f"bench --serve: {name}, {clients} client(s), {n} requests")
                summary = run_load(
                    url,
                    alias or model,
                    batch,
                    max_tokens=args.gen_tokens,
                    concurrency=clients,
                    requests=n,
                    time_limit_s=args.time_limit,
                )
                sides.setdefault(name, {})[str(clients)] = _figures(summary)
    return {
        "levels": levels,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "slots": slots,
        "sides": sides,
        "server_commands": {
            name: " ".join(Path(c[0]).name if i == 0 else c[i] for i in range(len(c))) for name, c, _, _ in servers
        },
        "ratios": _ratios(sides, levels) if "llama-server" in sides else None,
        "logs": str(work),
    }


def _served_model(url: str) -> str:
    with httpx.Client(trust_env=False) as client:
        return str(client.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def _figures(s: LoadSummary) -> dict[str, Any]:
    keep = ("requests", "ok", "refused", "lost", "wall_s", "requests_per_s", "output_tok_per_s", "ttft_p50_s")
    out = {k: getattr(s, k) for k in keep}
    out |= {"ttft_p99_s": s.ttft_p99_s, "itl_p50_s": s.itl_p50_s, "itl_p99_s": s.itl_p99_s}
    out["all_answered"] = s.ok + s.refused == s.requests and s.lost == 0
    return out


def _ratios(sides: dict[str, dict[str, Any]], levels: list[int]) -> dict[str, dict[str, float | None]]:
    out = {}
    for clients in map(str, levels):
        a, b = sides["llmplan"][clients], sides["llama-server"][clients]
        out[clients] = {
            "output_tok_s": _div(a["output_tok_per_s"], b["output_tok_per_s"]),
            "ttft_p50": _div(a["ttft_p50_s"], b["ttft_p50_s"]),
            "itl_p50": _div(a["itl_p50_s"], b["itl_p50_s"]),
        }
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def serve_markdown(result: dict[str, Any], machine: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = [
        f"# llmplan bench --serve: {result['plan']}",
        "",
        f"Machine: {machine['cpu']} ({', '.join(machine.get('cpu_features', []))}), {machine['cores']} cores; "
        f"load average {machine.get('loadavg')} at start, {machine.get('loadavg_end')} at the end.",
        f"Streaming chat completions on loopback, prompts of {result['prompt_tokens']} tokens (chat template "
        f"included, all distinct), {result['gen_tokens']} tokens out (greedy, EOS ignored), max(2 x clients, 4) "
        f"requests per level, closed loop; the two servers alternate per level. Both have {result['slots']} slots.",
        "",
        "| server | clients | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| refused | lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, levels in result["sides"].items():
        for clients, f in levels.items():
            cells = [f"{f['requests_per_s']:.2f}", f"{f['output_tok_per_s']:.1f}", ms(f["ttft_p50_s"])]
            cells += [ms(f["ttft_p99_s"]), ms(f["itl_p50_s"]), ms(f["itl_p99_s"]), str(f["refused"]), str(f["lost"])]
            lines.append(f"| {name} | {clients} | {' | '.join(cells)} |")
    if result.get("ratios"):
        lines += [
            "",
            "| clients | output tok/s, llmplan / llama-server | TTFT p50 ratio | ITL p50 ratio |",
            "|---:|---:|---:|---:|",
        ]
        for clients, r in result["ratios"].items():
            cells = [f"{v:.2f}x" if v is not None else "-" for v in (r["output_tok_s"], r["ttft_p50"], r["itl_p50"])]
            lines.append(f"| {clients} | {' | '.join(cells)} |")
    lines += ["", "Servers: " + "; ".join(f"`{c}`" for c in result["server_commands"].values()), ""]
    return "\n".join(lines)
