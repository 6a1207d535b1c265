"""The report's model graph, per-layer timings and attention pictures of a family other than Llama (#24):
drawn from a real run of a tiny checkpoint transformers made (tests/llm/archs.py), saying what the family
departs from Llama with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmplan.commands.report import build_report
from tests.llm.archs import WINDOW, make_tiny
from tests.stages.tiny_run import make_tokenizer, run_plan, wire_observers, write_plan

CHUNK = 24  # the first prefill chunk (the one the attention capture sees) is longer than the window
PROMPT = "Hello model, 注意力 and tokens: a sentence long enough to run past the sixteen-token window."


@pytest.fixture(scope="module")
def gemma3_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report-gemma3")
    patch = pytest.MonkeyPatch()
    try:
        wire_observers(patch)
        vocab = make_tokenizer(tmp / "tok-probe")  # the model's vocabulary covers the tokenizer's
        model_dir, _ = make_tiny(tmp, "gemma3_text", vocab_size=vocab)
        make_tokenizer(model_dir)
        observe = {"layer_timings": True, "attention": {"layers": [1, 2], "heads": [0], "max_tokens": 32}}
        path = write_plan(tmp, model_dir, observe=observe, prompt=PROMPT, name="gemma3")
        plan = yaml.safe_load(path.read_text(encoding="utf-8"))
        place = next(s for s in plan["stages"] if s["id"] == "place")
        place["with"] = {"kv_cache": {"max_tokens": 128, "chunk": CHUNK}}
        path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
        return run_plan(path, tmp / "run")
    finally:
        patch.undo()


def test_the_model_graph_draws_the_familys_layer(gemma3_run: Path) -> None:
    page = build_report(gemma3_run)
    assert not list(page.parent.glob("*.error.txt"))
    svg = (page.parent / "model_graph.svg").read_text(encoding="utf-8")
    for text in (
        "Model as loaded (gemma3_text): 4 layers",
        "split, q/k RMSNorm, RoPE (sliding layers: base 10000)",
        f"window {WINDOW} on 3 of 4 layers",
        "RMSNorm (post_attention_norm)",
        "RMSNorm (post_ffn_norm)",
        "GeGLU: gelu_tanh(gate) · up",
        "embedding × √dim",
        f"sliding layers keep {WINDOW + CHUNK} tokens",
        f"Q Kᵀ·{16**-0.5:.4g}",  # query_pre_attn_scalar 16
    ):
        assert text in svg, text
    assert "SwiGLU" not in svg


def test_layer_timings_cover_every_layer_of_the_family(gemma3_run: Path) -> None:
    page = build_report(gemma3_run)
    timings = json.loads((gemma3_run / "layer_timings.json").read_text())
    assert timings["n_layers"] == 4
    for phase in ("prefill", "decode"):
        assert len(timings[phase]["attention_ms"]) == len(timings[phase]["mlp_ms"]) == 4
    svg = (page.parent / "layer_timings.svg").read_text(encoding="utf-8")
    assert "MLP (norm, GeGLU, residual)" in svg


def test_attention_pictures_show_the_window_of_a_sliding_layer(gemma3_run: Path) -> None:
    page = build_report(gemma3_run)
    assert (page.parent / "attention.svg").exists()
    maps = {m["layer"]: m["weights"] for m in json.loads((gemma3_run / "attention.json").read_text())["maps"]}
    sliding, full = maps[1], maps[2]  # layer_types: sliding, sliding, full, sliding
    last = len(sliding) - 1
    assert last >= WINDOW  # the captured prompt runs past the window
    assert all(w == 0 for w in sliding[last][: last - WINDOW + 1]) and sum(sliding[last]) == pytest.approx(1.0)
    assert all(w > 0 for w in full[last][: last + 1])
