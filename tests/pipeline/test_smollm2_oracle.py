"""The bundled SmolLM2-135M in fp32, greedy, against transformers — token for token.

transformers loads the HF-format directory our GGUF import wrote; tests/llm/test_gguf_import.py shows
those tensors equal transformers' own GGUF loading exactly, so both engines run the same fp32 weights.
Both engines are given the same prompt ids (our tokenizer's), so this compares the forward pass,
the KV cache and the greedy loop, nothing else.

Where the engines part, the step must be a near-tie: at that step the top-two logits of transformers'
fp32 model are within NEAR_TIE. fp32 sums in a different order differ by ~1e-5 on logits of ~10-20
(a few ulps times 30 layers); a gap below 1e-3 can flip the argmax, a gap above it cannot.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .conftest import PLANS, run_plan

NEAR_TIE = 1e-3
NEW_TOKENS = 20
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "介绍大模型运行流程",
    "Write a Python function that reverses a string.",
    "What's 17 + 25? Answer with the number only.",
    "Give me a name for a pet llama 🦙.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p}]}) for i, p in enumerate(PROMPTS)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ours(out: Path, prompts_file: Path, batch: int):  # type: ignore[no-untyped-def]
    result = run_plan(
        PLANS / "llama-fp32.yaml",
        out,
        [
            f"prompt.prompts_file={prompts_file}",
            "prompt.messages=null",
            f"generate.max_new_tokens={NEW_TOKENS}",
            f"place.max_batch={batch}",
            "place.kv_cache.max_tokens=256",
        ],
        until="generate",
    )
    assert result.exit_code == 0, result.message
    ctx = result.context
    ours.scheduler = ctx.metrics.get("generate", "scheduler")  # type: ignore[attr-defined]
    return {r.id: r.prompt_ids for r in ctx.requests}, {g.request_id: g.tokens for g in ctx.generations}


@pytest.fixture(scope="module")
def one_by_one(prompts_file: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Our greedy run of the prompts on one slot, once for both tests (the reference of each)."""
    return ours(tmp_path_factory.mktemp("one-by-one"), prompts_file, batch=1)


def top_two_gap(model, ids: list[int]) -> float:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(model, prompt: list[int], a: list[int], b: list[int]) -> str | None:  # type: ignore[no-untyped-def]
    """None when equal; else where they part, after checking that the step was a near-tie."""
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            gap = top_two_gap(model, prompt + a[:step])
            assert gap < NEAR_TIE, f"tokens part at step {step} ({x} vs {y}) but the top-two gap is {gap:.2e}"
            return f"step {step}: near-tie, top-two gap {gap:.1e}"
    assert len(a) == len(b), f"same tokens, different lengths {len(a)} vs {len(b)}"
    return None


def test_fp32_greedy_matches_transformers_token_for_token(one_by_one, hf_model) -> None:  # type: ignore[no-untyped-def]
    prompt_ids, generated = one_by_one
    eos = hf_model.generation_config.eos_token_id
    ties = {}
    for request_id, prompt in prompt_ids.items():
        with torch.inference_mode():
            hf = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos if isinstance(eos, int) else eos[0],
            )
        reference = hf[0, len(prompt) :].tolist()
        tie = compare(hf_model, prompt, generated[request_id], reference)
        if tie:
            ties[request_id] = tie
    assert len(prompt_ids) == len(PROMPTS)
    # Near-ties are allowed, but most prompts must agree all the way.
    assert len(ties) <= 2, ties


def test_four_slots_equal_one_by_one(tmp_path: Path, prompts_file: Path, one_by_one, hf_model) -> None:  # type: ignore[no-untyped-def]
    """10 requests on 4 scheduler slots: rows of different lengths decode together, a request joins whenever
    one ends, and starts from the K/V of the chat template's system prompt that an earlier request computed."""
    prompt_ids, single = one_by_one
    _, batched = ours(tmp_path / "batched", prompts_file, batch=4)
    stats = ours.scheduler  # type: ignore[attr-defined]
    assert stats["slots"] == 4 and stats["busy_max"] == 4
    # The first four are admitted together, before any K/V exist; each of the six after them starts from
    # the system prompt's ~24 tokens (prefix reuse covers computed K/V only, as vLLM's prefix caching).
    assert stats["reused_prefix_tokens"] >= 6 * 20, stats
    assert len({len(p) for p in prompt_ids.values()}) > 1, "prompts of different lengths"
    ties = {rid: t for rid in single if (t := compare(hf_model, prompt_ids[rid], batched[rid], single[rid]))}
    assert len(ties) <= 2, ties
