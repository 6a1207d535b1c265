"""`llmplan bench --vs llama.cpp --llama-type`: which GGUF llama.cpp runs beside which llmplan dtype.

The pairing and parsing are checked directly; the command end to end runs a tiny GGUF plan through the real
engine, with llama.cpp's tools stood in for by scripts that record what they were given (the real tools are
measured in benchmarks/, never in a test): the file as shipped must reach llama-bench untouched, a requantized
one must come from llama-quantize, and the table must name the type each file's header says.
"""

from __future__ import annotations

import json
import math
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmplan.commands.bench import llama_cpp
from llmplan.commands.bench.llama_cpp import AS_SHIPPED, closest_dtype, llama_grid, parse_llama_types
from llmplan.engine.cli import CliError, main
from llmplan.engine.memory import mib
from llmplan.llm.formats.gguf import gguf_type, nominal_bits, open_gguf
from tests.llm.test_gguf_import import _write_tiny
from tests.stages.tiny_run import load_stages

gguf = pytest.importorskip("gguf")


def test_types_are_parsed_case_blind_with_optional_dtypes() -> None:
    assert parse_llama_types("q8_0, Q4_1,As-Shipped,int8=bf16") == [
        (None, "Q8_0"),
        (None, "Q4_1"),
        (None, AS_SHIPPED),
        ("int8", "BF16"),
    ]
    for bad, named in (("Q9_9", "'Q9_9'"), ("int3=Q8_0", "'int3'"), (" , ", "expected")):
        with pytest.raises(ValueError, match=named):
            parse_llama_types(bad)


def test_each_type_pairs_with_the_dtype_closest_in_bits() -> None:
    assert [nominal_bits(n) for n in ("Q4_K_M", "IQ4_XS", "Q8_0", "BF16", "F32", "Q6_K")] == [4, 4, 8, 16, 32, 6]
    every = ["fp32", "fp16", "bf16", "int8", "int4"]
    assert [closest_dtype(k, every) for k in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "BF16", "F16", "F32")] == [
        "int4",
        "int4",
        "int8",  # 6 bits: 1.33x from 8, 1.5x from 4
        "int8",
        "bf16",
        "fp16",
        "fp32",
    ]
    assert closest_dtype("BF16", ["int8", "fp32"]) == "fp32"  # only among the dtypes run; a tie: the more bits


def test_the_grid_one_load_per_dtype_as_shipped_is_the_file_type() -> None:
    entries = parse_llama_types("Q8_0,Q4_1,as-shipped,BF16,F32")
    assert llama_grid(None, entries, "Q4_K_M") == [
        ("int8", ["Q8_0"]),
        ("int4", ["Q4_1", "Q4_K_M"]),
        ("bf16", ["BF16"]),
        ("fp32", ["F32"]),
    ]
    # --dtype keeps its order; a dtype no type names runs against its default (None); DTYPE= adds one
    assert llama_grid(["int8", "fp32"], parse_llama_types("int4=Q4_K_M,Q6_K"), "Q4_K_M") == [
        ("int8", ["Q6_K"]),
        ("fp32", None),
        ("int4", ["Q4_K_M"]),
    ]
    assert llama_grid(["int8"], None, None) == [("int8", None)]
    with pytest.raises(CliError, match="comes from a GGUF"):
        llama_grid(None, [(None, AS_SHIPPED)], None)


def test_the_type_is_read_from_the_header_else_from_most_weights(tmp_path: Path) -> None:
    _write_tiny(tmp_path / "typed.gguf", file_type=15)  # MOSTLY_Q4_K_M
    typed = gguf_type(tmp_path / "typed.gguf")
    assert (typed.name, typed.source) == ("Q4_K_M", "general.file_type")
    _write_tiny(tmp_path / "plain.gguf")
    plain = gguf_type(tmp_path / "plain.gguf")
    assert (plain.name, plain.source) == ("Q4_1", "most weights")  # the FFN matrices outweigh the rest
    assert sum(plain.tensor_bytes.values()) < plain.file_bytes == (tmp_path / "plain.gguf").stat().st_size
    assert set(plain.tensor_bytes) == {"F32", "Q8_0", "Q4_1"}


_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps({{"tool": "llama-bench", "model": args[args.index("-m") + 1]}}) + "\\n")
print(json.dumps([{{"avg_ts": 123.0}}]))
"""
_BATCHED = """#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps({{"tool": "llama-batched-bench", "model": args[args.index("-m") + 1]}}) + "\\n")
print(json.dumps({{"speed_tg": 45.0, "speed_pp": 300.0}}))
"""
# llama-quantize's stand-in writes a real GGUF of the asked type: one Q8_0 matrix and its file type
_QUANTIZE = """#!{python}
import json, sys
import numpy as np
import gguf
from gguf.quants import quantize
_, source, out, kind = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps({{"tool": "llama-quantize", "model": source, "type": kind}}) + "\\n")
writer = gguf.GGUFWriter(out, "llama")
writer.add_file_type(int(gguf.LlamaFileType["MOSTLY_" + kind]))
writer.add_tensor("w", quantize(np.ones((4, 32), np.float32), gguf.GGMLQuantizationType.Q8_0),
                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
"""


@pytest.fixture(scope="module")
def tiny_gguf_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("llama-type")
    model = tmp / "tiny-q4_1.gguf"
    _write_tiny(model)  # no file type: "Q4_1" by most weights
    stages = load_stages(model)
    stages[1]["with"]["cache_dir"] = str(tmp / "imports")
    plan = {"name": "tiny-gguf", "device": "cpu", "seed": 0, "threads": 1, "stages": stages}
    path = tmp / "tiny-gguf.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False), encoding="utf-8")
    return path


def _fake_tools(bin_dir: Path, log: Path) -> None:
    bin_dir.mkdir(parents=True)
    for name, text in (("llama-bench", _BENCH), ("llama-batched-bench", _BATCHED), ("llama-quantize", _QUANTIZE)):
        tool = bin_dir / name
        tool.write_text(text.format(python=sys.executable, log=str(log)), encoding="utf-8")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


def test_as_shipped_runs_the_file_itself_beside_a_requantized_one(
    tiny_gguf_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir, log = tmp_path / "llama" / "bin", tmp_path / "calls.jsonl"
    _fake_tools(bin_dir, log)
    monkeypatch.setattr(llama_cpp, "llama_bin", lambda build, say: bin_dir)
    shipped = tiny_gguf_plan.parent / "tiny-q4_1.gguf"
    args = ["bench", str(tiny_gguf_plan), "--vs", "llama.cpp", "--runs", "2", "--batch", "2"]
    args += ["--prompt-tokens", "6", "--gen-tokens", "3", "--llama-type", "Q8_0,as-shipped", "--format", "json"]
    args += ["--set", "convert.bf16_inputs=true"]  # a plan override: recorded, so that a rerun can pass it again
    args += ["--set", "place.kv_cache.dtype=fp16"]  # llama.cpp's own KV cache format, said beside it
    args += ["--out", str(tmp_path / "vs-qwen2.5")]  # a dot in the prefix is kept: vs-qwen2.5.md
    ran: list[tuple[int, int]] = []  # llmplan's runs in order: (rows, tokens)
    run_once = llama_cpp.run_once

    def recorded(model: Any, cache: Any, prompts: list[list[int]], gen_tokens: int) -> dict[str, Any]:
        ran.append((len(prompts), gen_tokens))
        return run_once(model, cache, prompts, gen_tokens)

    monkeypatch.setattr(llama_cpp, "run_once", recorded)
    assert main(args) == 0
    # per dtype: the load's warm-ups, then each run warms batch 1 before measuring it, as llama-bench warms
    warm = (1, llama_cpp.WARM_TOKENS)
    assert ran == ([(1, 3), (2, 3)] + [warm, (1, 3), (2, 3)] * 2) * 2
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["set"] == ["convert.bf16_inputs=true", "place.kv_cache.dtype=fp16"]
    assert result["settings"]["kv_cache"] == {"int8": "float16", "int4": "float16"}
    rows = {(r["dtype"], r["figure"]): r for r in result["rows"]}
    assert set(rows) == {(d, f) for d in ("int8", "int4") for f in llama_cpp.FIGURES}
    int8, int4 = rows[("int8", "decode_b1")], rows[("int4", "decode_b1")]
    assert (int4["gguf_type"], int4["gguf_type_from"], int4["as_shipped"]) == ("Q4_1", "most weights", True)
    assert int4["gguf_file"] == shipped.name and int4["gguf_bytes"] == shipped.stat().st_size
    assert (int8["gguf_type"], int8["gguf_type_from"], int8["as_shipped"]) == ("Q8_0", "general.file_type", False)
    assert int8["gguf_file"] == "tiny-q4_1.requant-Q8_0.gguf"
    for row in result["rows"]:
        assert row["llmplan"]["n"] == 2 and row["llama_cpp"]["median"] in (123.0, 45.0) and row["ratio"] > 0
    # batch-1 decode as a read rate: llama.cpp reads its file's tensors but the embedding table (this file has
    # its own head), llmplan its resident matrices, vectors and head, each at its median tok/s
    with open_gguf(shipped) as file:
        shipped_read = sum(t.nbytes for name, t in file.tensors.items() if name != "token_embd.weight")
        assert "output.weight" in file.tensors
    with open_gguf(bin_dir.parent / "models" / "tiny-q4_1.requant-Q8_0.gguf") as file:
        requant_read = sum(t.nbytes for t in file.tensors.values())  # the stand-in's one matrix "w"
    for row, theirs in ((int8, requant_read), (int4, shipped_read)):
        parts = result["memory"][row["dtype"]]["parts"]
        mine = sum(parts[p]["resident_bytes"] for p in ("matrices", "vectors", "head"))
        assert parts["embeddings"]["resident_bytes"] > 0
        assert row["read_bytes"] == {"llmplan": mine, "llama_cpp": theirs}
        assert row["read_gb_s"]["llama_cpp"] == pytest.approx(theirs * 123.0 / 1e9)
        assert row["read_gb_s"]["llmplan"] == pytest.approx(mine * row["llmplan"]["median"] / 1e9)
        # beside them the memory's plain read, once a run, and each side's share of its best
        memory = row["memory_read_gb_s"]
        assert memory["n"] == 2 and all(math.isfinite(v) and v > 0 for v in memory["samples"])
        for side in ("llmplan", "llama_cpp"):
            assert row["memory_share"][side] == pytest.approx(row["read_gb_s"][side] / memory["max"])
    assert all("read_bytes" not in r for r in result["rows"] if r["figure"] != "decode_b1")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # one requantization, none of the file as shipped; each run: llama-bench (pp, tg) and the batched one
    assert [c for c in calls if c["tool"] == "llama-quantize"] == [
        {"tool": "llama-quantize", "model": str(shipped), "type": "Q8_0"}
    ]
    benched = [Path(c["model"]).name for c in calls if c["tool"] != "llama-quantize"]
    assert benched == ["tiny-q4_1.requant-Q8_0.gguf"] * 6 + [shipped.name] * 6
    md = (tmp_path / "vs-qwen2.5.md").read_text()
    assert json.loads((tmp_path / "vs-qwen2.5.json").read_text())["rows"] == result["rows"]
    assert "Plan overrides: --set convert.bf16_inputs=true --set place.kv_cache.dtype=fp16." in md
    assert "KV cache: llmplan float16 (int8), float16 (int4); llama.cpp float16 (its default)." in md
    assert "| batch 1 decode | int4 | Q4_1 (as shipped) |" in md
    assert "| aggregate decode (batch 2) | int8 | Q8_0 (requantized) |" in md
    rate = int4["read_gb_s"]["llmplan"]
    share, memory = int4["memory_share"]["llmplan"], int4["memory_read_gb_s"]
    line = f"- int4 / Q4_1: llmplan {int4['read_bytes']['llmplan'] / 1e9:.3f} GB a token at {rate:.1f} GB/s ({share:.0%})"
    assert line in md
    assert f"; the memory {memory['median']:.1f} [{memory['min']:.1f}-{memory['max']:.1f}] GB/s" in md
    sizes = f"Q8_0 {mib(int8['gguf_bytes'])}, Q4_1 {mib(shipped.stat().st_size)}"
    assert f"Memory: llama.cpp's GGUFs {sizes}; llmplan's resident weights per dtype:" in md
    for dtype in ("int8", "int4"):  # the footprint line per dtype, its ratio against the shipped file
        ratio = result["memory"][dtype]["weights_bytes"] / shipped.stat().st_size
        assert f"- {dtype}: weights {mib(result['memory'][dtype]['weights_bytes'])} = {ratio:.2f}x the GGUF's" in md
    # the shipped type's own name means the file too: no second requantization, the same rows
    log.unlink()
    assert main([*args[:-2], "--dtype", "int4", "--llama-type", "q4_1"]) == 0
    again = json.loads(capsys.readouterr().out)["rows"]
    assert {r["gguf_file"] for r in again} == {shipped.name} and all(r["as_shipped"] for r in again)
    assert all(json.loads(line)["tool"] != "llama-quantize" for line in log.read_text().splitlines())


def test_llama_type_without_llama_cpp_is_one_line(tiny_gguf_plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tiny_gguf_plan), "--llama-type", "Q8_0"]) == 1
    assert "add --vs llama.cpp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", str(tiny_gguf_plan), "--vs", "llama.cpp", "--llama-type", "Q9_9"])
    assert "'Q9_9' is not a llama.cpp type" in capsys.readouterr().err


def test_the_stored_dtype_runs_beside_the_file_it_maps() -> None:
    """`load.convert: stored` keeps the GGUF's own blocks: llama.cpp's side is that file, never a requantized one,
    and an as-shipped type goes to `stored` when it is in the grid."""
    from llmplan.commands.bench.llama_cpp import default_type, llama_grid

    assert default_type("stored", "Q4_K_M") == "Q4_K_M"
    assert default_type("int4", "Q4_K_M") == "Q4_1"
    grid = llama_grid(["stored", "int4"], [(None, "as-shipped")], "Q4_K_M")
    assert grid == [("stored", ["Q4_K_M"]), ("int4", None)]
    assert llama_grid(["int8", "int4"], [(None, "as-shipped")], "Q4_K_M") == [("int8", None), ("int4", ["Q4_K_M"])]
    # no --dtype: a plan that keeps its file's blocks pairs the file with itself, a converting one by bits
    assert llama_grid(None, [(None, "as-shipped")], "Q4_K_M", plan_dtype="stored") == [("stored", ["Q4_K_M"])]
    assert llama_grid(None, [(None, "as-shipped")], "Q4_K_M", plan_dtype="int8") == [("int4", ["Q4_K_M"])]
