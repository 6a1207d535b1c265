"""Issue 25's memory line: a GGUF import's resident weights against the GGUF's own size, and why.

A tiny Llama GGUF (Q8_0 embeddings, Q4_1 and Q8_0 and F32 matrices, an untied F32 head) run through the real
engine at int8: every part's bytes are checked against what the formats make of the file's own shapes
(int8: a byte a weight and an fp32 scale a row; the embeddings and norms fp32), the ratio against the file's
size on disk, and the line in both memory tables (the report's and `llmplan bench`'s).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from html import unescape
from pathlib import Path

import pytest
import yaml

from llmplan.engine.cli import main
from llmplan.engine.memory import mib
from llmplan.llm.formats.gguf import gguf_read_per_token, open_gguf, read_per_token, recorded_footprint
from tests.llm.test_gguf_import import _write_tiny
from tests.stages.tiny_run import load_stages, run_plan

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the GGUF, the plan, a run's directory)."""
    tmp = tmp_path_factory.mktemp("footprint")
    model = tmp / "tiny.gguf"
    _write_tiny(model, file_type=3)  # MOSTLY_Q4_1, as llama-quantize would say of most of its weights
    stages = load_stages(model)
    stages[1]["with"]["cache_dir"] = str(tmp / "imports")
    stages[6]["with"]["dtype"] = "int8"
    stages += [
        {"id": "prompt", "uses": "compute.tokenize", "with": {"text": "the"}},
        {"id": "generate", "uses": "compute.generate", "with": {"max_new_tokens": 2, "temperature": 0}},
    ]
    plan = tmp / "tiny-gguf.yaml"
    body = {"name": "tiny-gguf", "device": "cpu", "seed": 0, "threads": 1, "stages": stages}
    plan.write_text(yaml.safe_dump({**body, "observe": {"memory_interval_ms": 5}}, sort_keys=False))
    return model, plan, run_plan(plan, tmp / "run")


def _expected(model: Path) -> dict[str, int]:
    """What int8 with fp32 embeddings and norms makes of the file's tensors, by their shapes alone."""
    want = {"embeddings": 0, "head": 0, "matrices": 0, "vectors": 0}
    with open_gguf(model) as file:
        for name, tensor in file.tensors.items():
            rows, count = tensor.shape[0], math.prod(tensor.shape)
            if name == "token_embd.weight":
                want["embeddings"] += count * 4
            elif len(tensor.shape) == 1:
                want["vectors"] += count * 4
            else:
                want["head" if name == "output.weight" else "matrices"] += count + rows * 4
    return want


def test_the_parts_and_the_ratio_come_from_the_real_tensors(tiny: tuple[Path, Path, Path]) -> None:
    model, _, run = tiny
    place = json.loads((run / "metrics.json").read_text())["place"]
    recorded = place["resident_weights"]  # what the load recorded: the resident side only
    want = _expected(model)
    assert {part: recorded["parts"][part]["bytes"] for part in want} == want
    assert recorded["gguf_file"] == str(model)
    fp = recorded_footprint(recorded)  # the file's side, read when a table is drawn
    assert fp is not None
    assert {part: fp["parts"][part]["resident_bytes"] for part in want} == want
    assert fp["weights_bytes"] == sum(want.values()) == place["regions"]["weights"]
    size = model.stat().st_size
    assert (fp["gguf_file"], fp["gguf_type"], fp["gguf_bytes"]) == ("tiny.gguf", "Q4_1", size)
    assert fp["ratio"] == pytest.approx(sum(want.values()) / size)
    parts = fp["parts"]
    assert (parts["embeddings"]["resident_as"], parts["embeddings"]["gguf_as"]) == ("fp32", "Q8_0")
    assert parts["matrices"]["resident_as"] == "int8"
    assert sorted(parts["matrices"]["gguf_as"].split("/")) == ["F32", "Q4_1", "Q8_0"]
    assert (parts["head"]["resident_as"], parts["head"]["gguf_as"]) == ("int8", "F32")
    with open_gguf(model) as file:
        stored = sum(t.nbytes for t in file.tensors.values())
    assert fp["gguf_metadata_bytes"] == size - stored > 0 and not fp["head_tied_in_gguf"]


def test_the_report_memory_table_says_it(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    from llmplan.commands.report.figures_memory_plan import draw_memory_plan
    from llmplan.commands.report.run_data import RunData

    model, _, run = tiny
    (figure,) = draw_memory_plan(RunData.load(run), tmp_path)
    rows = {
        cells[0]: cells[1:]
        for cells in (re.findall(r"<t[hd]>([^<]*)</t[hd]>", row) for row in figure.html.split("<tr>")[2:])
    }
    fp = recorded_footprint(json.loads((run / "metrics.json").read_text())["place"]["resident_weights"])
    assert fp is not None
    predicted, measured, diff = rows["the GGUF file (Q4_1)"]
    assert (unescape(measured), diff) == (mib(model.stat().st_size), f"weights {fp['ratio']:.2f}x")
    assert "MiB" not in predicted  # a file size is not predicted
    (line,) = [n for n in figure.notes if n.startswith("weights ")]
    assert f"= {fp['ratio']:.2f}x the GGUF's {mib(model.stat().st_size)} (Q4_1)" in line
    assert (
        "embeddings" in line and "fp32 against" in line and "Q8_0 in the file (kept fp32 for the row gathers)" in line
    )
    assert "dequantized and re-quantized to int8" in line


def test_bench_memory_lines_say_it(tiny: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model, plan, _ = tiny
    args = ["bench", str(plan), "--batch", "1", "--runs", "1", "--prompt-tokens", "6", "--gen-tokens", "3"]
    assert main([*args, "--no-cold"]) == 0
    md = capsys.readouterr().out
    (line,) = [line for line in md.splitlines() if line.startswith("  - weights ")]
    assert re.search(r"= \d+\.\d\dx the GGUF's " + re.escape(mib(model.stat().st_size)) + r" \(Q4_1\)", line)


def test_no_line_when_the_file_is_gone(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A GGUF moved or replaced since the run: the table leaves the row out rather than say something wrong."""
    from llmplan.commands.report.figures_memory_plan import draw_memory_plan
    from llmplan.commands.report.run_data import RunData

    _, _, run = tiny
    recorded = json.loads((run / "metrics.json").read_text())["place"]["resident_weights"]
    assert recorded_footprint(recorded | {"gguf_file": str(tmp_path / "gone.gguf")}) is None
    (tmp_path / "not.gguf").write_bytes(b"GGUF but not really")
    assert recorded_footprint(recorded | {"gguf_file": str(tmp_path / "not.gguf")}) is None
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    metrics = json.loads((copy / "metrics.json").read_text())
    metrics["place"]["resident_weights"]["gguf_file"] = str(tmp_path / "gone.gguf")
    (copy / "metrics.json").write_text(json.dumps(metrics))
    (figure,) = draw_memory_plan(RunData.load(copy), tmp_path)
    assert "GGUF" not in figure.html and not [n for n in figure.notes if n.startswith("weights ")]


@pytest.mark.parametrize("own_head", [False, True])
def test_decode_reads_the_head_once_tied_or_not(tmp_path: Path, own_head: bool) -> None:
    """The bytes a batch-1 decode step reads (bench --vs llama.cpp's read rate): the embedding table only where
    it is the head, on both sides."""
    import numpy as np

    path = tmp_path / "tied.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tensors = {"token_embd.weight": (16, 32), "blk.0.ffn_up.weight": (8, 32), "output_norm.weight": (32,)}
    if own_head:
        tensors["output.weight"] = (16, 32)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    table, matrix, norm = 16 * 32 * 4, 8 * 32 * 4, 32 * 4
    assert gguf_read_per_token(path) == matrix + norm + table  # its own head or the table as the head: one table
    parts = {"embeddings": table, "matrices": matrix, "vectors": norm, "head": table if own_head else 0}
    resident = {"parts": {p: {"bytes": b} for p, b in parts.items()}, "head_shares_embeddings": not own_head}
    assert read_per_token(resident) == matrix + norm + table
    assert read_per_token(resident | {"head_shares_embeddings": False}) == matrix + norm + parts["head"]


def test_a_stored_line_says_mapped_whatever_order_the_types_are_named_in() -> None:
    """A mixed Q4_K_M file run as stored names its types in another order than the model does (Gemma: the
    file's Q5_0 first, the model's Q4_K): still the file's own blocks, not a re-quantization."""
    from llmplan.llm.formats.gguf.footprint import footprint_line

    def part(resident: str, gguf: str) -> dict[str, object]:
        return {"resident_as": resident, "gguf_as": gguf, "resident_bytes": 1 << 20, "gguf_bytes": 1 << 20}

    fp = {
        "parts": {
            "embeddings": part("Q8_0", "Q8_0"),
            "head": part("Q8_0", "Q8_0") | {"resident_bytes": 0},
            "matrices": part("Q4_K/Q5_0/Q6_K", "Q5_0/Q6_K/Q4_K"),
        },
        "weights_bytes": 2 << 20, "gguf_bytes": 2 << 20, "ratio": 1.0, "gguf_type": "Q4_K_M",
        "head_tied_in_gguf": True, "head_shares_embeddings": True, "gguf_metadata_bytes": 1 << 20,
    }  # fmt: skip
    line = footprint_line(fp, lambda n: f"{n >> 20} MiB")
    assert "the file's own blocks, mapped" in line and "re-quantized" not in line
    fp["parts"]["matrices"] = part("int4", "Q5_0/Q6_K/Q4_K")
    assert "re-quantized to int4" in footprint_line(fp, lambda n: f"{n >> 20} MiB")
