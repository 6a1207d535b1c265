"""Observers: model.json from the loaded model, hooks only when asked, timings per layer, exact attention."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from llmplan.llm.model import Transformer
from llmplan.stages import compute_generate
from llmplan.stages.observe import install_observers, model_summary
from llmplan.stages.observe_settings import AttentionCapture, Observe
from tests.llm.tiny import load_tiny
from tests.stages.tiny_run import make_tiny_model_dir, run_plan, wire_observers, write_plan

N_LAYERS, NEW_TOKENS = 3, 12


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), n_layers=N_LAYERS)


@pytest.fixture(scope="module")
def model(tiny: tuple[Path, Any]) -> Transformer:
    return load_tiny(tiny[0])


@pytest.fixture
def wired(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The observe wiring, plus a spy counting the forward hooks on the model generate runs."""
    wire_observers(monkeypatch)
    seen: dict[str, int] = {}
    inner = compute_generate.Generate.run

    def spy(self: Any, ctx: Any, params: Any) -> None:
        seen["hooks"] = hook_count(ctx.model)
        inner(self, ctx, params)

    monkeypatch.setattr(compute_generate.Generate, "run", spy)
    return seen


def test_nothing_asked_installs_nothing(model: Transformer) -> None:
    assert install_observers(model, Observe()) is None
    assert hook_count(model) == 0


def test_nothing_asked_in_a_run_costs_nothing(tiny: tuple[Path, Any], tmp_path: Path, wired: dict[str, int]) -> None:
    run = run_plan(write_plan(tmp_path, tiny[0]), tmp_path / "run")
    assert wired["hooks"] == 0
    assert not (run / "layer_timings.json").exists() and not (run / "attention.json").exists()
    assert (run / "model.json").is_file() and (run / "generations.json").is_file()


def test_model_json_matches_the_config(tiny: tuple[Path, Any], tmp_path: Path, wired: dict[str, int]) -> None:
    run = run_plan(write_plan(tmp_path, tiny[0]), tmp_path / "run")
    cfg = tiny[1].config
    summary = json.loads((run / "model.json").read_text())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert summary["n_layers"] == cfg.num_hidden_layers == len(summary["layer_kinds"])
    assert (summary["dim"], summary["n_heads"], summary["n_kv_heads"], summary["head_dim"]) == (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        head_dim,
    )
    mods = summary["modules"]
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    assert mods["layers.0.attention.wqkv"]["tensors"]["weight"]["shape"] == [qkv, cfg.hidden_size]
    assert mods["layers.0.feed_forward.w13"]["tensors"]["weight"]["shape"] == [
        2 * cfg.intermediate_size,
        cfg.hidden_size,
    ]
    assert mods["tok_embeddings"]["tensors"]["weight"]["shape"] == [cfg.vocab_size, cfg.hidden_size]
    assert mods["output"]["kind"] == "FloatLinear" and mods["output"]["format"] == "fp32"
    assert summary["activation_dtype"] == "float32"
    assert summary["kv_cache"]["shape"] == [cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 128, head_dim]
    generations = json.loads((run / "generations.json").read_text())
    assert len(generations[0]["tokens"]) == len(generations[0]["logprobs"]) == NEW_TOKENS


def test_observed_run_records_timings_and_attention(
    tiny: tuple[Path, Any], tmp_path: Path, wired: dict[str, int]
) -> None:
    observe = {"layer_timings": True, "attention": {"layers": [0, -1], "heads": [0, 3], "max_tokens": 8}}
    run = run_plan(write_plan(tmp_path, tiny[0], observe=observe), tmp_path / "run")
    assert wired["hooks"] == 0  # attention comes from a pass after the run: the generation runs unhooked
    timings = json.loads((run / "layer_timings.json").read_text())
    assert timings["n_layers"] == N_LAYERS
    assert timings["prefill"]["passes"] == 1
    assert timings["decode"]["passes"] == NEW_TOKENS - 1  # the first token comes from prefill
    for phase in ("prefill", "decode"):
        for key in ("attention_s", "mlp_s"):
            assert len(timings[phase][key]) == N_LAYERS and all(t > 0 for t in timings[phase][key])
        for key in ("attention_ms", "mlp_ms"):
            spread = timings[phase][key]
            assert len(spread) == N_LAYERS and all(0 < s["min"] <= s["median"] <= s["max"] for s in spread)
    assert timings["load_average"] is not None
    attention = json.loads((run / "attention.json").read_text())
    assert attention["layers"] == [0, N_LAYERS - 1] and attention["ignored"]["layers"] == []
    assert len(attention["token_ids"]) == 8 and len(attention["pieces"]) == 8
    assert [(m["layer"], m["head"]) for m in attention["maps"]] == [(0, 0), (0, 3), (2, 0), (2, 3)]
    for m in attention["maps"]:
        weights = torch.tensor(m["weights"])
        assert weights.shape == (8, 8)
        assert torch.allclose(weights.sum(-1), torch.ones(8), atol=1e-5)
        assert torch.all(weights.triu(1) == 0)  # causal


def test_attention_equals_transformers_eager(tiny: tuple[Path, Any], model: Transformer) -> None:
    hf = tiny[1]
    hf.config._attn_implementation = "eager"
    tokens = torch.tensor([[1, 40, 41, 50, 60, 70, 80, 90, 100]])
    settings = Observe(attention=AttentionCapture(layers=[0, 1, 2], heads=[0, 1, 2, 3], max_tokens=64))
    observer = install_observers(model, settings)
    assert observer is not None
    observer.capture(tokens[0].tolist(), [])
    with torch.inference_mode():
        expected = hf(tokens, output_attentions=True).attentions
    assert hook_count(model) == 0
    record = observer.attention_record()
    assert record is not None and record["token_ids"] == tokens[0].tolist() and record["decode"] is None
    assert "after the run" in record["taken"]
    for m in record["maps"]:
        ref = expected[m["layer"]][0, m["head"]].float()
        torch.testing.assert_close(torch.tensor(m["weights"]), ref, atol=1e-5, rtol=1e-4)


def test_prompt_attention_keeps_its_first_tokens(model: Transformer) -> None:
    """max_tokens keeps the prompt's first tokens: their rows see only kept tokens, as over the prompt alone."""
    prompt = [1, 40, 41, 50, 60, 70, 80]
    maps = []
    for max_tokens, generated in ((4, [90, 100]), (64, [])):
        observer = install_observers(
            model, Observe(attention=AttentionCapture(layers=[1], heads=[2], max_tokens=max_tokens))
        )
        assert observer is not None
        observer.capture(prompt if max_tokens == 4 else prompt[:4], generated)
        record = observer.attention_record()
        assert record is not None and record["token_ids"] == prompt[:4]
        maps.append(torch.tensor(record["maps"][0]["weights"]))
    torch.testing.assert_close(maps[0], maps[1], atol=1e-5, rtol=1e-4)


def test_model_summary_without_a_cache(model: Transformer) -> None:
    summary = model_summary(model)
    assert summary["n_layers"] == N_LAYERS and "kv_cache" not in summary
    assert summary["layers_identical"] and summary["modules"]["norm"]["kind"] == "RMSNorm"


def test_attention_choice_is_checked_against_the_model(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    """A layer or head the model does not have stops the run with the plan's file:line:field (was: ignored)."""
    from llmplan.engine.cli import main

    observe = {"attention": {"layers": [0, 99], "heads": [0, 7]}}
    plan = write_plan(tmp_path, tiny[0], observe=observe)
    assert main(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"]) == 1
    message = json.loads((tmp_path / "run" / "run.json").read_text())["message"]
    assert f"{plan}:" in message
    assert "observe.attention.layers[1]: layer 99 does not exist: the model has 3 layers" in message
    assert "observe.attention.heads[1]: head 7 does not exist: the model has 4 query heads (0..3)" in message


def test_layer_timings_keep_the_fused_step(tiny: tuple[Path, Any], tmp_path: Path, wired: dict[str, int]) -> None:
    """Timings need no hooks: prefill and decode stay on the path they take unobserved (the fused native pass
    where it applies)."""
    from llmplan.llm.kernels import native

    run = run_plan(write_plan(tmp_path, tiny[0], observe={"layer_timings": True}), tmp_path / "run")
    assert wired["hooks"] == 0
    timings = json.loads((run / "layer_timings.json").read_text())
    expected = "fused" if native.kernels() is not None else "torch"
    assert timings["decode"]["paths"] == {expected: NEW_TOKENS - 1}
    assert timings["prefill"]["paths"] == {expected: 1}
    for phase in ("prefill", "decode"):  # the pass's own clock marks: every layer's span is positive
        for key in ("attention_ms", "mlp_ms"):
            assert all(s["min"] > 0 for s in timings[phase][key])
    trace = json.loads((run / "trace.json").read_text())
    passes = [e for e in trace["traceEvents"] if e.get("cat") == "pass" and e["name"].startswith("decode")]
    assert len(passes) == NEW_TOKENS - 1 and all(f"({expected})" in e["name"] for e in passes)


def test_decode_attention_equals_transformers(tiny: tuple[Path, Any], model: Transformer) -> None:
    """The decode steps' rows: each generated token's query over the prompt and the tokens before it."""
    hf = tiny[1]
    hf.config._attn_implementation = "eager"
    prompt, generated = [1, 40, 41, 50, 60], [70, 80, 90, 100]
    observer = install_observers(model, Observe(attention=AttentionCapture(layers=[1], heads=[2], max_tokens=64)))
    assert observer is not None
    observer.capture(prompt, generated)
    observer.remove()
    record = observer.attention_record()
    assert record is not None and record["decode"] is not None
    decode = record["decode"]
    assert decode["prompt_tokens"] == 5 and decode["rows"]["token_ids"] == generated
    assert decode["columns"]["token_ids"] == prompt + generated[:-1]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt + generated[:-1]]), output_attentions=True).attentions[1][0, 2].float()
    [m] = decode["maps"]
    torch.testing.assert_close(torch.tensor(m["weights"]), expected[4:], atol=1e-5, rtol=1e-4)
