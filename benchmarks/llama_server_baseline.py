"""llama.cpp's llama-server on the Q8_0 SmolLM2 under the load generator: the baseline of `llmplan bench --serve`.

    .venv/bin/python benchmarks/llama_server_baseline.py            # writes benchmarks/llama-server-baseline.md/.json

Builds llama-server and the Q8_0 GGUF when missing (benchmarks/build_llama_server.sh, benchmarks/smollm2_q8_0.sh),
starts `llama-server --parallel 16` on a free loopback port, and runs 1, 4 and 16 concurrent streaming clients
with prompts of `--prompt-tokens` tokens as the server counts them (chat template included) and
`--max-tokens` tokens out (EOS ignored), `max(2 x C, --min-requests)` (default 4) requests per level, every prompt
distinct so no request reuses another's prompt cache beyond the shared template prefix. One warm-up request
first. The server is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from llmplan.commands.bench.load_generator import LoadSummary, build_prompts, format_summary, run_load

HERE = Path(__file__).resolve().parent
# CPU features that matter to llama.cpp's CPU kernels (ggml picks its paths from these at build time).
FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
            "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def sh(script: str) -> str:
    """Run one of the benchmark shell scripts and return the path it prints on its last line."""
    out = subprocess.run([str(HERE / script)], check=True, stdout=subprocess.PIPE, text=True).stdout
    return out.strip().splitlines()[-1]


def cpu_info() -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "features": [f for f in FEATURES if f in flags], "cores": os.cpu_count()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
            try:
                if client.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    raise RuntimeError(f"llama-server not ready after {timeout_s:g} s")


def measure_levels(
    client: httpx.Client, url: str, args: argparse.Namespace, levels: list[int]
) -> tuple[int, list[LoadSummary]]:
    """Against a ready server: the chat template's token count, a warm-up request, then each concurrency level."""
    results: list[LoadSummary] = []

    def tokens(text: str) -> int:
        r = client.post("/tokenize", json={"content": text})
        r.raise_for_status()
        return len(r.json()["tokens"])

    # The chat template's tokens, measured once: usage.prompt_tokens minus the bare text's tokens.
    probe = "count these words"
    r = client.post("/v1/chat/completions", json={
        "model": "smollm2-q8_0", "max_tokens": 1, "messages": [{"role": "user", "content": probe}]})
    r.raise_for_status()
    overhead = r.json()["usage"]["prompt_tokens"] - tokens(probe)

    counts = [max(args.min_requests, 2 * c) for c in levels]
    prompts = build_prompts(1 + sum(counts), args.prompt_tokens, lambda t: tokens(t) + overhead, seed=14)
    warm = run_load(url, "smollm2-q8_0", prompts[:1], max_tokens=args.max_tokens, requests=1)
    print("warm-up:", format_summary(warm), file=sys.stderr)
    start = 1
    for c, n in zip(levels, counts, strict=True):
        s = run_load(url, "smollm2-q8_0", prompts[start:start + n], max_tokens=args.max_tokens,
                     concurrency=c, requests=n, time_limit_s=args.time_limit)
        start += n
        print(format_summary(s), file=sys.stderr)
        results.append(s)
    return overhead, results


def run_meta(
    args: argparse.Namespace, load_before: tuple[float, float, float], server_bin: str, model: str, version: str,
    cmd: list[str], overhead: int,
) -> dict[str, Any]:
    """What the figures were measured on: the machine, the llama.cpp build, the model, the server command."""
    root = Path(server_bin).parent.parent
    return {
        "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_info(),
        "threads": args.threads,
        "llama_server_version": version,
        "llama_cpp_python_sdist": root.name,
        "llama_cpp_commit": (root / "LLAMA_CPP_COMMIT").read_text().strip() if (root / "LLAMA_CPP_COMMIT").exists()
        else None,
        "build_flags": (root / "BUILD_FLAGS").read_text().strip() if (root / "BUILD_FLAGS").exists() else None,
        "model": model,
        "model_source": Path(model + ".source").read_text().strip(),
        "server_command": " ".join(["llama-server", "-m", Path(model).name, *cmd[3:]]),
        "prompt_tokens_target": args.prompt_tokens,
        "template_tokens": overhead,
        "max_tokens": args.max_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,4,16", help="concurrent clients per level")
    ap.add_argument("--min-requests", type=int, default=4, help="at least this many requests per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=16, help="llama-server --parallel (slots)")
    ap.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server -c is this x --parallel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=600.0, help="per level, seconds")
    ap.add_argument("--out", default=str(HERE / "llama-server-baseline"), help="output path without suffix")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.levels.split(",")]

    load_before = os.getloadavg()
    server_bin = sh("build_llama_server.sh")
    model = sh("smollm2_q8_0.sh")
    root = Path(server_bin).parent.parent
    version = subprocess.run([server_bin, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True).stdout.strip()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [server_bin, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(args.parallel),
           "-c", str(args.ctx_per_slot * args.parallel), "-t", str(args.threads), "--alias", "smollm2-q8_0"]
    log_path = root / "llama-server-baseline.log"  # the server's own log, kept out of the repository
    results: list[LoadSummary] = []
    overhead = 0
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        client = httpx.Client(base_url=url, trust_env=False, timeout=30)
        try:
            wait_ready(url, proc)

            overhead, results = measure_levels(client, url, args, levels)
        finally:
            client.close()
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    meta = run_meta(args, load_before, server_bin, model, version, cmd, overhead)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "levels": [s.as_dict() for s in results]},
                                                   indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(meta, results))
    print(args.out + ".md")
    return 0 if all(s.lost == 0 and s.ok == s.requests for s in results) else 1


def markdown(meta: dict[str, Any], results: list[LoadSummary]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    rows = [
        f"| {s.concurrency} | {s.requests} | {s.ok} | {s.requests_per_s:.2f} | {s.output_tok_per_s:.1f} | "
        f"{ms(s.ttft_p50_s)} | {ms(s.ttft_p99_s)} | {ms(s.itl_p50_s)} | {ms(s.itl_p99_s)} | "
        f"{s.refused} | {s.lost} | {'-' if s.prompt_tokens_mean is None else f'{s.prompt_tokens_mean:.0f}'} | "
        f"{'yes' if all(r.output_tokens == s.max_tokens for r in s.records if r.outcome == 'ok') else 'no'} |"
        for s in results
    ]
    cpu = meta["cpu"]
    return "\n".join([
        "# llama-server baseline (SmolLM2-135M-Instruct Q8_0)",
        "",
        "The llama.cpp side of `llmplan bench --serve` (issue 14): llama.cpp's own server, built from the llama.cpp "
        "that llama-cpp-python's source distribution vendors, on the Q8_0 GGUF of the bundled model, under "
        "`commands/bench/load_generator.py` on loopback (streaming chat completions, greedy, EOS ignored). "
        "Reproduce with `.venv/bin/python benchmarks/llama_server_baseline.py`.",
        "",
        f"- Measured: {meta['date']}; one pass per level, on a shared machine: read ratios measured in one run, "
        "not these absolute figures.",
        f"- CPU: {cpu['model']}, {cpu['cores']} cores visible; features: {' '.join(cpu['features'])}",
        f"- Threads: {meta['threads']} (`-t`); 1-minute load average before/after the run: "
        f"{meta['loadavg_1m_before_after'][0]} / {meta['loadavg_1m_before_after'][1]} (other work shares the cores)",
        f"- llama.cpp: {meta['llama_server_version'].splitlines()[0].removeprefix('version: ')}"
        f" — commit {meta['llama_cpp_commit']}, vendored in llama-cpp-python {meta['llama_cpp_python_sdist']} "
        f"(benchmarks/build_llama_server.sh: Release, `{meta['build_flags']}`, no CURL/OpenSSL, static"
        + ("; AMX is listed by cpuid but faults here, so ggml runs its AVX-512 kernels)" if "no-amx" in
           (meta["build_flags"] or "") else ")"),
        f"- Model: {Path(meta['model']).name}, made by {meta['model_source']}",
        f"- Server: `{meta['server_command']}`",
        f"- Prompts: {meta['prompt_tokens_target']} tokens each as the server counts them "
        f"(chat template's {meta['template_tokens']} included), all distinct; {meta['max_tokens']} tokens out; "
        "requests per level: max(2 x clients, 4), closed loop (each client sends its next request when its "
        "last one ends); one warm-up request before the levels.",
        "",
        "| clients | requests | ok | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| refused | lost | prompt tokens | all 128 out |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "TTFT is from sending the request to the first content delta; ITL pools every gap between content deltas "
        "of all answered requests; rates divide by the wall time from the first request sent to the last one "
        "finished. Full per-level numbers: `llama-server-baseline.json`.",
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
