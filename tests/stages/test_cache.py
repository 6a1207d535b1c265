from __future__ import annotations

import json

import pytest

from llmplan.engine.findings import StageFailure
from llmplan.engine.runner import Runner
from llmplan.stages.cache_stages import CacheLookup, LookupParams, OutputCache, StoreParams, generation_params
from llmplan.stages.results.store import ResultsStore, cache_key
from llmplan.stages.types import ModelSource, Result


def _plan_text(tokenizer_dir, db, *, prompts=("Tell me about the sky.",), mode="reuse", json_out=None) -> str:
    sinks = [{"json": str(json_out)}] if json_out else ["stdout_json"]
    return f"""
name: cache-test
seed: 3
stages:
  - {{id: source, uses: fake.source, with: {{tokenizer_dir: {json.dumps(str(tokenizer_dir))}, prompts: {json.dumps(list(prompts))}}}}}
  - {{id: weights, uses: fake.weights}}
  - {{id: lookup, uses: cache.lookup, with: {{db: {json.dumps(str(db))}, mode: {mode}}}}}
  - {{id: generate, uses: fake.generate, with: {{temperature: 0.5}}}}
  - {{id: post, uses: output.postprocess}}
  - {{id: detok, uses: output.detokenize}}
  - {{id: write, uses: output.write, with: {{to: {json.dumps(sinks)}}}}}
  - {{id: store, uses: output.cache, with: {{db: {json.dumps(str(db))}}}}}
  - {{id: release, uses: output.release}}
"""


def test_key_is_sensitive_to_everything_that_decides_the_output():
    base = {"fingerprint": "fp", "prompt_ids": [1, 2, 3], "params": {"temperature": 0.7}, "overrides": {}, "seed": 0}

    def key(**changes):
        args = {**base, **changes}
        return cache_key(args["fingerprint"], args["prompt_ids"], args["params"], args["overrides"], args["seed"])

    reference = key()
    assert reference == key() and len(reference) == 64
    variants = [
        key(params={"temperature": 0.8}),
        key(seed=1),
        key(prompt_ids=[1, 2, 4]),
        key(prompt_ids=[1, 2]),
        key(fingerprint="fp2"),
        key(overrides={"max_new_tokens": 5}),
    ]
    assert len({reference, *variants}) == len(variants) + 1
    assert key(params={"temperature": 0.7}) == reference  # same values, same key


def test_key_uses_the_plan_as_resolved(ctx, make_plan, tokenizer_dir, tmp_path):
    text = _plan_text(tokenizer_dir, tmp_path / "r.sqlite")
    ctx.plan = make_plan(text)
    params, seed = generation_params(ctx, "generate")
    assert params == {"temperature": 0.5, "max_new_tokens": 16, "answer": "The sky is blue."} and seed == 3
    ctx.plan = make_plan(text, ["generate.temperature=0.9", "seed=4"])
    assert generation_params(ctx, "generate") == ({**params, "temperature": 0.9}, 4)
    with pytest.raises(StageFailure, match="generate_stage: no stage with id 'gen'"):
        generation_params(ctx, "gen")


def _run(make_plan, tmp_path, text, name):
    from llmplan.stages.slots import InferenceContext

    ctx = InferenceContext()
    ctx.json_mode = True
    run_dir = tmp_path / name
    run_dir.mkdir()
    result = Runner(make_plan(text), ctx, run_dir).run()
    assert result.status == "ok", result.message
    return {r.id: r.status for r in result.records}, ctx


def test_hit_skips_generation_and_weights(make_plan, tokenizer_dir, tmp_path, capsys):
    db = tmp_path / "results.sqlite"
    text = _plan_text(tokenizer_dir, db, prompts=["Tell me about the sky.", "And the grass?"])
    first, ctx1 = _run(make_plan, tmp_path, text, "run1")
    assert first["generate"] == "ok" and first["weights"] == "ok" and first["lookup"] == "ok"
    assert ctx1.metrics.get("lookup", "hits") == 0 and db.is_file()
    fresh = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    second, ctx2 = _run(make_plan, tmp_path, text, "run2")
    assert second["generate"] == "skipped" and second["weights"] == "skipped"  # no weights loaded on a hit
    assert second["store"] == "ok" and second["release"] == "ok"
    assert ctx2.metrics.get("lookup", "hits") == 2
    assert all(g.from_cache for g in ctx2.generations)
    replayed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (
        [r["text"] for r in replayed]
        == [r["text"] for r in fresh]
        == [
            "The sky is blue. (r0)",
            "The sky is blue. (r1)",
        ]
    )
    assert [r["tokens"] for r in replayed] == [r["tokens"] for r in fresh]
    assert [r["logprobs"] for r in replayed] == [r["logprobs"] for r in fresh]
    assert all(r["from_cache"] for r in replayed) and not any(r["from_cache"] for r in fresh)
    with ResultsStore(db) as store:
        assert store.count("runs") == 2 and store.count("results") == 4


def test_miss_on_changed_params_partial_hit_refresh_and_off(make_plan, tokenizer_dir, tmp_path, capsys):
    db = tmp_path / "results.sqlite"
    _run(make_plan, tmp_path, _plan_text(tokenizer_dir, db), "seed-run")
    # changed temperature: a miss
    changed = _plan_text(tokenizer_dir, db).replace("temperature: 0.5", "temperature: 0.6")
    records, _ = _run(make_plan, tmp_path, changed, "changed")
    assert records["generate"] == "ok"
    # one request stored, one new: a partial hit recomputes everything
    partial = _plan_text(tokenizer_dir, db, prompts=["Tell me about the sky.", "Something new"])
    records, ctx = _run(make_plan, tmp_path, partial, "partial")
    assert records["generate"] == "ok" and ctx.metrics.get("lookup", "hits") == 1
    assert not any(g.from_cache for g in ctx.generations)
    for mode in ("refresh", "off"):
        records, ctx = _run(make_plan, tmp_path, _plan_text(tokenizer_dir, db, mode=mode), mode)
        assert records["generate"] == "ok" and not any(g.from_cache for g in ctx.generations)
    capsys.readouterr()


def test_lookup_without_database_is_a_miss_and_creates_nothing(ctx, make_plan, tokenizer, tokenizer_dir, tmp_path, req):
    db = tmp_path / "absent.sqlite"
    ctx.plan = make_plan(_plan_text(tokenizer_dir, db))
    ctx.model_source = ModelSource(tmp_path, "hf-dir", "fp")
    ctx.requests = [req(tokenizer, "a", "hi")]
    CacheLookup().run(ctx, LookupParams(db=str(db), mode="reuse"))
    assert ctx.generations is None and not db.exists()
    assert ctx.metrics.get("run", "misses") == 1


def test_errors_are_stored_but_never_replayed(ctx, make_plan, tokenizer, tokenizer_dir, tmp_path, req):
    db = tmp_path / "r.sqlite"
    ctx.plan = make_plan(_plan_text(tokenizer_dir, db))
    ctx.model_source = ModelSource(tmp_path, "hf-dir", "fp")
    ctx.requests = [req(tokenizer, "a", "hi")]
    ctx.completions = [Result.failed("a", 1, "out of memory", prompt="hi")]
    OutputCache().run(ctx, StoreParams(db=str(db)))
    assert ctx.cache_record["keys"] == [None] and ctx.cache_record["results"] == 1
    CacheLookup().run(ctx, LookupParams(db=str(db), mode="reuse"))
    assert ctx.generations is None
