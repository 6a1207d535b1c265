"""The three phases as data flow, every number taken from the run's own metrics.

load:    files on disk → host buffer → conversion → device regions
compute: prompt → ids → prefill → decode loop (⇄ KV cache) → generated ids
output:  ids → clean ids → text → each sink → release
A stage the plan does not have (or that did not run) is drawn hatched and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import MISSING, PHASE_COLORS, Figure, mib, rate, seconds
from .diagram import Below, Box, draw_flow
from .run_data import RunData

NOT_IN_PLAN = "not in plan / not run"


def _get(metrics: dict[str, Any] | None, key: str) -> Any:
    return None if metrics is None else metrics.get(key)


def _box(title: str, metrics: dict[str, Any] | None, lines: list[str], phase: str, uses: str) -> Box:
    if metrics is None:
        return Box(title, [f"({uses}: {NOT_IN_PLAN})"], missing=True)
    return Box(title, lines, PHASE_COLORS[phase])


def draw_load_flow(run: RunData, out_dir: Path) -> Figure:
    verify, stream = run.metrics_of("load.verify"), run.metrics_of("load.shard_stream")
    convert, place = run.metrics_of("load.convert"), run.metrics_of("load.to_device")
    # The stream stage sets the reading up; the stage that drains it (convert) records the reader's numbers.
    read = None if stream is None else {**stream, **(convert or {})}
    files = _files_box(verify, read)
    buffer = _box(
        "host buffer",
        read,
        [
            f"peak {mib(_get(read, 'peak_buffer_bytes'))}",
            f"{_get(read, 'peak_buffer_shards') or MISSING} shard(s) at once",
            f"{_get(read, 'tensors_wanted') or MISSING} tensors",
        ],
        "load",
        "load.shard_stream",
    )
    conversion = _box(
        f"conversion → {_get(convert, 'dtype') or '?'}",
        convert,
        [f"{mib(_get(convert, 'bytes_before'))} → {mib(_get(convert, 'bytes_after'))}"]
        + (
            [f"quant error max {_get(convert, 'quant_error_max'):.3g}"]
            if _get(convert, "quant_error_max") is not None
            else []
        ),
        "load",
        "load.convert",
    )
    regions = _get(place, "regions") or {}
    device = _box(
        f"device regions ({_get(place, 'device') or '?'})",
        place,
        [
            f"weights {mib(regions.get('weights'))}",
            f"KV cache {mib(regions.get('kv_cache'))}",
            f"work buffers {mib(regions.get('work_buffers'))}",
        ],
        "load",
        "load.to_device",
    )
    footer = f"place (to device) took {seconds(_get(place, 'wall_s'))}" if place else ""
    title, middle, arrows = _road(read, convert, buffer, conversion)
    path = draw_flow(title, [[files], *middle, [device]], arrows, out_dir / "flow_load.svg", footer=footer)
    return Figure(
        "flow_load",
        "Load phase",
        path,
        "The road the weights took (mapped as stored, mapped from the conversion cache, converted and cached, or "
        "converted in memory); bytes and seconds on each arrow come from the read, convert and place stages' metrics.",
    )


def _road(
    read: dict[str, Any] | None, convert: dict[str, Any] | None, buffer: Box, conversion: Box
) -> tuple[str, list[list[Box]], list[str]]:
    """(title, the columns between the files and the device, the arrows' labels) for the road load.convert took."""
    road = _get(convert, "weights_road")
    color = PHASE_COLORS["load"]
    if road == "stored":
        types = "/".join(_get(convert, "stored_types") or {}) or "?"
        lines = [f"mapped as stored: {types}", "nothing converted or copied whole"]
        blocks = Box("the GGUF's own blocks", lines, color)
        arrows = [f"mapped {mib(_get(convert, 'bytes_before'))}", f"{mib(_get(convert, 'bytes_after'))} as stored"]
        return "Load: the GGUF mapped as stored → device", [[blocks]], arrows
    entry = Box("conversion cache entry", _entry_lines(convert), color)
    if road == "cache-mapped":
        mapped = f"mapped in {seconds(_get(convert, 'convert_s'))}"
        arrows = ["no shard read: the entry keyed\nby these files' SHA-256", mapped]
        return "Load: files → conversion cache entry (mapped) → device", [[entry]], arrows
    arrows = _load_arrows(read, convert)
    if road == "cached":
        arrows.append(f"written in {seconds(_get(convert, 'entry_write_s'))},\nthen mapped")
        title = "Load: files → host buffer → conversion → conversion cache → device"
        return title, [[buffer], [conversion], [entry]], arrows
    why = _get(convert, "weights_road_why")
    if why:
        conversion.lines.append(f"in memory, not cached: {why}")
    return "Load: files → host buffer → conversion → device", [[buffer], [conversion]], arrows


def _entry_lines(convert: dict[str, Any] | None) -> list[str]:
    name = str(_get(convert, "conversion_entry") or "?").rsplit("/", 1)[-1]
    hashed = _get(convert, "entry_bytes_hashed")
    checked = "checked: file identities cached" if not hashed else f"checked: {mib(hashed)} hashed"
    return [name, f"{mib(_get(convert, 'entry_bytes'))} file-backed", checked]


def _files_box(verify: dict[str, Any] | None, read: dict[str, Any] | None) -> Box:
    """The checkpoint's files: how many, their size, and what load.verify hashed."""
    shards = _get(read, "shards")
    n_shards = len(shards) if isinstance(shards, list) else _get(verify, "shards")
    on_disk = _get(verify, "bytes") or (sum(s.get("bytes", 0) for s in shards) if isinstance(shards, list) else None)
    return Box(
        "files on disk",
        [f"{n_shards if n_shards is not None else MISSING} shards", mib(on_disk)]
        + (
            [f"verified: {mib(_get(verify, 'bytes_hashed'))} hashed in {seconds(_get(verify, 'seconds'))}"]
            if verify
            else ["not verified (no load.verify)"]
        ),
        PHASE_COLORS["load"],
        missing=verify is None and read is None,
    )


def _load_arrows(read: dict[str, Any] | None, convert: dict[str, Any] | None) -> list[str]:
    """The labels between the load boxes: bytes read and how fast, bytes streamed, bytes converted."""
    read_s = _get(read, "read_s")
    return [
        f"read {mib(_get(read, 'bytes_read'))}\nin {seconds(read_s)} ({_bandwidth(_get(read, 'bytes_read'), read_s)})"
        if read
        else MISSING,
        f"{mib(_get(convert, 'bytes_before'))}\nstreamed tensor by tensor" if convert else MISSING,
        f"{mib(_get(convert, 'bytes_after'))}\nconverted in {seconds(_get(convert, 'convert_s'))}"
        if convert
        else MISSING,
    ]


def _bandwidth(nbytes: float | None, wall: float | None) -> str:
    if nbytes is None or not wall:
        return MISSING
    return f"{nbytes / wall / (1 << 20):,.0f} MiB/s"


def draw_compute_flow(run: RunData, out_dir: Path) -> Figure:
    tokenize, generate, place = (
        run.metrics_of("compute.tokenize"),
        run.metrics_of("compute.generate"),
        run.metrics_of("load.to_device"),
    )
    prompt_tokens = _get(tokenize, "prompt_tokens") or []
    per_request = _get(generate, "per_request") or []
    total_prompt = sum(prompt_tokens) if prompt_tokens else None
    generated = _get(generate, "generated_tokens")
    prefill_s = max((r.get("prefill_s", 0.0) for r in per_request), default=None)
    n_req = _get(tokenize, "requests")
    prompt = _box("prompt", tokenize, [f"{n_req} request(s)"], "compute", "compute.tokenize")
    ids = _box(
        "prompt ids",
        tokenize,
        [
            f"{total_prompt} tokens" if total_prompt is not None else MISSING,
            f"per request: {', '.join(map(str, prompt_tokens[:4]))}{' …' if len(prompt_tokens) > 4 else ''}",
        ],
        "compute",
        "compute.tokenize",
    )
    prefill = _box(
        "prefill",
        generate,
        [
            f"{total_prompt} prompt tokens" if total_prompt is not None else MISSING,
            seconds(prefill_s),
            rate(total_prompt, prefill_s, "tok"),
        ],
        "compute",
        "compute.generate",
    )
    decode, out = _decode_box(generate, per_request), _generated_box(generate)
    cache = _kv_cache_box(place, prompt_tokens, generated, len(per_request))
    arrows = ["tokenize + chat template", "token ids", "first token,\nK/V of the prompt", "one token per step"]
    below = [Below(3, cache, "append K,V\n(1 token/step)", "attend over\nall cached")]
    path = draw_flow(
        "Compute: prompt → ids → prefill → decode (with the KV cache) → generated ids",
        [[prompt], [ids], [prefill], [decode], [out]],
        arrows,
        out_dir / "flow_compute.svg",
        below=below,
    )
    return Figure(
        "flow_compute",
        "Compute phase",
        path,
        "Token counts and rates from the tokenize and generate stages; the cache shape from place.",
    )


def _decode_box(generate: dict[str, Any] | None, per_request: list[dict[str, Any]]) -> Box:
    """The decode loop: its steps after the first token, its time and per-request rate."""
    generated = _get(generate, "generated_tokens")
    decode_s = max((r.get("decode_s", 0.0) for r in per_request), default=None)
    decode_rates = [r.get("decode_tokens_per_s") for r in per_request if r.get("decode_tokens_per_s")]
    decoded = (generated - len(per_request)) if generated is not None else None  # the first token comes from prefill
    return _box(
        "decode loop",
        generate,
        [
            f"{max(decoded or 0, 0)} steps after the first token",
            seconds(decode_s),
            f"{sum(decode_rates) / len(decode_rates):,.1f} tok/s per request" if decode_rates else MISSING,
        ],
        "compute",
        "compute.generate",
    )


def _generated_box(generate: dict[str, Any] | None) -> Box:
    return _box(
        "generated ids",
        generate,
        [
            f"{_get(generate, 'generated_tokens')} tokens",
            f"finish: {', '.join(sorted(set(_get(generate, 'finish_reasons') or []))) or MISSING}",
            f"overall {_get(generate, 'tokens_per_s') or 0:,.1f} tok/s",
        ],
        "compute",
        "compute.generate",
    )


def _kv_cache_box(place: dict[str, Any] | None, prompt_tokens: list[int], generated: int | None, rows: int) -> Box:
    """The KV cache's shape and about how many of its token slots the longest request used."""
    shape = _get(place, "kv_cache_shape")
    used = (max(prompt_tokens, default=0) + (generated or 0) // max(rows, 1)) if prompt_tokens else None
    return _box(
        "KV cache",
        place,
        [
            f"shape {'×'.join(map(str, shape)) if shape else MISSING}",
            "(layer, batch, head, token, dim)",
            f"~{used} of {shape[3]} token slots used" if shape and used is not None else MISSING,
        ],
        "compute",
        "load.to_device",
    )


def draw_output_flow(run: RunData, out_dir: Path) -> Figure:
    generate, post = run.metrics_of("compute.generate"), run.metrics_of("output.postprocess")
    detok, filt = run.metrics_of("output.detokenize"), run.metrics_of("output.filter")
    write, release = run.metrics_of("output.write"), run.metrics_of("output.release")
    ids = _box(
        "generated ids", generate, [f"{_get(generate, 'generated_tokens')} tokens"], "compute", "compute.generate"
    )
    clean = _box(
        "clean ids",
        post,
        [
            f"{_get(post, 'answers')} answer(s)",
            f"{_get(post, 'invalid_ids')} invalid ids dropped",
            f"{_get(post, 'trimmed')} trimmed",
        ],
        "output",
        "output.postprocess",
    )
    text = _box(
        "text",
        detok,
        [f"{_get(detok, 'completions')} completion(s)", f"{_get(detok, 'chars')} characters"]
        + ([f"filter: {_get(filt, 'flagged')} flagged"] if filt else []),
        "output",
        "output.detokenize",
    )
    deliveries = _get(write, "deliveries")
    if write is None:
        sinks = [Box("sinks", [f"(output.write: {NOT_IN_PLAN})"], missing=True)]
    else:
        sinks = [Box("sink", [str(d)], PHASE_COLORS["output"]) for d in (deliveries or [])[:5]] or [
            Box("sinks", ["no deliveries"], PHASE_COLORS["output"])
        ]
    freed = _get(release, "freed_bytes")
    rel = _box(
        "release",
        release,
        [
            f"freed {mib(freed)}",
            f"RSS {mib(_get(release, 'rss_before'))} → {mib(_get(release, 'rss_after'))}",
            f"released: {', '.join(_get(release, 'released') or []) or 'nothing'}",
        ],
        "output",
        "output.release",
    )
    arrows = ["drop specials,\ninvalid ids", "detokenize", "deliver", "then free memory"]
    path = draw_flow(
        "Output: ids → clean ids → text → sinks → release",
        [[ids], [clean], [text], sinks, [rel]],
        arrows,
        out_dir / "flow_output.svg",
    )
    return Figure(
        "flow_output",
        "Output phase",
        path,
        "Hatched boxes are stages this plan does not have (or that did not run): their numbers are not shown.",
    )


def draw_flows(run: RunData, out_dir: Path) -> list[Figure]:
    return [draw_load_flow(run, out_dir), draw_compute_flow(run, out_dir), draw_output_flow(run, out_dir)]
