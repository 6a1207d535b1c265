"""Do greedy answers to JSON Schemas end by themselves? The share that do within 96 new tokens (issue #56: >= 95 %).

    .venv/bin/python benchmarks/schema_answers_end.py [--plan plans/llama-int8.yaml] [--tokens 96]
        [--corpus] [--out benchmarks/schema-answers-end]

The plan's model is loaded once through the engine (up to `load.to_device`); each probe (a question and the
JSON Schema a client sends with it, as OpenAI's `response_format` or a tool's parameters would: string,
integer, number, boolean, array and enum fields, nested objects, mostly without `maxLength`, bounds or
`additionalProperties`) is compiled as the server compiles a schema (`OutputFormat.from_json_schema`, the kept
schema: objects closed, numbers bounded in digits) and answered greedy, all probes at once in the engine loop.
An answer ends by itself when its finish is the end token within the budget; each answer is also checked to
parse and validate (`jsonschema`). `--corpus` adds the 55 schemas of the structured-output proof
(tests/pipeline/data/schema_corpus.py) at the same budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from constrained_decode import load
from speculative_decode import encode, features, report

STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
UNIT = {"enum": ["celsius", "fahrenheit"]}
MOOD = {"enum": ["positive", "negative", "neutral"]}


def obj(required: bool = True, **properties: Any) -> dict[str, Any]:
    shape: dict[str, Any] = {"type": "object", "properties": properties}
    return shape | ({"required": list(properties)} if required else {})


# (name, question, schema): the kinds of schema people send, as they send them
PROBES: list[tuple[str, str, dict[str, Any]]] = [
    ("city", "Describe New York City.", obj(city=STR, population=INT)),
    ("person", "Describe a person.", obj(name=STR, age=INT, email=STR)),
    ("product", "Describe a product for sale.", obj(name=STR, price=NUM, in_stock=BOOL)),
    ("weather", "What is the weather in Paris?", obj(city=STR, temperature=NUM, unit=UNIT)),
    ("book", "Describe a famous book.", obj(title=STR, author=STR, year=INT, genres={"type": "array", "items": STR})),
    ("movie", "Recommend a movie.", obj(title=STR, rating=NUM, reasons={"type": "array", "items": STR, "maxItems": 3})),
    ("sentiment", "Classify: 'I love this phone'.", obj(sentiment=MOOD, confidence=NUM)),
    ("address", "Give the address of the White House.", obj(street=STR, city=STR, zip=STR, country=STR)),
    ("user", "Describe a user and their address.", obj(name=STR, address=obj(street=STR, city=STR))),
    ("order", "Describe an order of two items.", obj(id=INT, items={"type": "array", "items": obj(name=STR, qty=INT)})),
    ("event", "Describe a concert.", obj(name=STR, date=STR, attendees=INT, sold_out=BOOL)),
    ("recipe", "Give a short recipe.", obj(dish=STR, minutes=INT, steps={"type": "array", "items": STR})),
]  # fmt: skip


def corpus() -> list[tuple[str, str, dict[str, Any]]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: `tests` as the suite imports it
    from tests.pipeline.data.schema_corpus import CORPUS

    return [(f"corpus:{name}", question, schema) for name, question, schema, _ in CORPUS]


def answers(
    ctx: Any, probes: list[tuple[str, str, dict[str, Any]]], tokens: int, penalty: float
) -> list[dict[str, Any]]:
    """Each probe's greedy answer under its kept schema (with a repetition penalty, 1: none), in one engine loop."""
    from llmplan.llm.generation import EngineLoop
    from llmplan.llm.generation.engine_loop import GenerationRequest
    from llmplan.llm.kv import SlotCache
    from llmplan.llm.sampling import OutputFormat, build_picker, compile_format
    from llmplan.llm.sampling.chain import SamplingParams

    eos = frozenset(i for i in (ctx.tokenizer.eos_id,) if i is not None)
    loop = EngineLoop(ctx.model_runner, SlotCache.over(ctx.kv_cache), max_running=ctx.kv_cache.max_batch)
    seqs = []
    for _, question, schema in probes:
        grammar = compile_format(OutputFormat.from_json_schema(schema), ctx.tokenizer, eos, ctx.model_config.vocab_size)
        prompt = encode(ctx, question)
        picker = build_picker(
            SamplingParams.trusted(temperature=0.0, repetition_penalty=penalty, grammar=grammar), len(prompt)
        )
        seqs.append(loop.submit(GenerationRequest(prompt=prompt, picker=picker, max_new_tokens=tokens, eos_ids=eos)))
    loop.run()
    return [_row(probe, seq.generation, ctx.tokenizer) for probe, seq in zip(probes, seqs, strict=True)]


def _row(probe: tuple[str, str, dict[str, Any]], gen: Any, tok: Any) -> dict[str, Any]:
    import jsonschema

    name, _, schema = probe
    text = tok.decode(gen.tokens, skip_special_tokens=True)
    try:
        jsonschema.validate(json.loads(text), schema)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    ended = gen.finish_reason == "eos"
    return {"name": name, "ended": ended, "valid": valid, "tokens": len(gen.tokens), "text": text}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from llmplan.commands.bench.report import machine

    ctx = load(args.plan)
    probes = PROBES + (corpus() if args.corpus else [])
    runs = {}
    for penalty in args.repetition_penalty:
        rows = answers(ctx, probes, args.tokens, penalty)
        for r in rows:
            print(f"{penalty} {r['name']:>24} {'ends' if r['ended'] else 'CUT '} {r['text']!r}", file=sys.stderr)
        runs[str(penalty)] = {"shares": _shares(rows), "rows": rows}
    return {
        "plan": args.plan, "max_new_tokens": args.tokens, "machine": machine(), "features": features(),
        "runs": runs,
    }  # fmt: skip


def _shares(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per set (the probes; the corpus where asked): how many, how many ended, how many of those validate."""
    sets = {"probes": [r for r in rows if not r["name"].startswith("corpus:")]}
    if any(r["name"].startswith("corpus:") for r in rows):
        sets["corpus"] = [r for r in rows if r["name"].startswith("corpus:")]
    return {
        key: {
            "n": len(part),
            "ended": sum(r["ended"] for r in part),
            "valid_of_ended": sum(r["valid"] for r in part if r["ended"]),
        }
        for key, part in sets.items()
    }


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# Greedy schema answers that end by themselves",
        "",
        f"`{result['plan']}`, greedy, at most {result['max_new_tokens']} new tokens; {m.get('cpu', '?')}, "
        f"{result['features']}. An answer ends when its finish is the end token; every ended answer is checked "
        "to parse and validate against its schema.",
        "",
        "| repetition penalty | set | schemas | end by themselves | share | valid (of those) |",
        "|---|---|---|---|---|---|",
    ]
    for penalty, run in result["runs"].items():
        for key, s in run["shares"].items():
            share = s["ended"] / s["n"] if s["n"] else 0.0
            lines.append(f"| {penalty} | {key} | {s['n']} | {s['ended']} | **{share:.0%}** | {s['valid_of_ended']} |")
    for penalty, run in result["runs"].items():
        cut = [r for r in run["rows"] if not r["ended"]]
        if cut:
            lines += ["", f"Cut at the budget (repetition penalty {penalty}):", ""]
            lines += [f"- `{r['name']}`: `{r['text'][:120]}`" for r in cut]
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="plans/llama-int8.yaml")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--corpus", action="store_true", help="add the structured-output proof's 55 schemas")
    parser.add_argument(
        "--repetition-penalty", type=float, nargs="+", default=[1.0], help="one run per value (1: greedy as asked)"
    )
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    return report(parser.parse_args(argv), measure, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
