"""Corpus: malformed plans, generated from every shipped plan, each refused the same way.

Refused means: exit 1, every stderr line `FILE:LINE:COLUMN: …` (or the `--set` pseudo-file), no
exception class name, no traceback, and nothing written (no run directory, no output file). Each
mutation is applied to each shipped plan, so a new plan is covered without a new test.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmplan.engine.cli import main

PLANS = sorted((Path(__file__).resolve().parents[2] / "plans").glob("*.yaml"))
EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception|Interrupt)\b|Traceback")
Data = dict[str, Any]


def _stage(data: Data, uses: str) -> Data:
    return next(s for s in data["stages"] if s["uses"] == uses)


def _with(data: Data, uses: str) -> Data:
    return _stage(data, uses).setdefault("with", {})


def _set(path: str, value: Any) -> Callable[[Data], None]:
    def change(data: Data) -> None:
        target: Any = data
        *parts, last = path.split(".")
        for part in parts:
            target = target.setdefault(part, {})
        target[last] = value

    return change


def _gen(key: str, value: Any) -> Callable[[Data], None]:
    return lambda data: _with(data, "compute.generate").__setitem__(key, value)


def _place(key: str, value: Any) -> Callable[[Data], None]:
    return lambda data: _with(data, "load.to_device").setdefault("kv_cache", {}).__setitem__(key, value)


def _dup_id(data: Data) -> None:
    data["stages"][1]["id"] = data["stages"][0]["id"]


def _cycle(data: Data) -> None:
    _stage(data, "model.source")["after"] = [_stage(data, "compute.generate")["id"]]


def _drop_source(data: Data) -> None:
    data["stages"] = [s for s in data["stages"] if s["uses"] != "model.source"]


def _unknown_uses(data: Data) -> None:
    _stage(data, "output.detokenize")["uses"] = "output.detokenise"


def _missing_id(data: Data) -> None:
    del data["stages"][0]["id"]


def _with_list(data: Data) -> None:
    _stage(data, "compute.generate")["with"] = [1, 2]


def _prompt(data: Data, **values: Any) -> None:
    params = _with(data, "compute.tokenize")
    for key in ("messages", "text", "prompts_file"):
        params.pop(key, None)
    params.update(values)


DATA_MUTATIONS: dict[str, Callable[[Data], None]] = {
    "unknown-top-key": _set("stagez", []),
    "name-list": _set("name", ["a"]),
    "name-pattern": _set("name", "has space"),
    "device-tpu": _set("device", "tpu"),
    "seed-negative": _set("seed", -1),
    "seed-bool": _set("seed", True),
    "threads-zero": _set("threads", 0),
    "version-2": _set("version", 2),
    "stages-empty": _set("stages", []),
    "stages-mapping": _set("stages", {"a": 1}),
    "observe-unknown": _set("observe.sample_everything", True),
    "observe-heads-negative": _set("observe.attention", {"heads": [-1]}),
    "observe-interval-string": _set("observe.memory_interval_ms", "fast"),
    "duplicate-id": _dup_id,
    "cycle": _cycle,
    "no-writer": _drop_source,
    "unknown-stage": _unknown_uses,
    "missing-id": _missing_id,
    "with-list": _with_list,
    "after-unknown": lambda d: d["stages"][2].__setitem__("after", ["nowhere"]),
    "gen-unknown-param": _gen("temprature", 0.5),
    "gen-max-tokens-bool": _gen("max_new_tokens", True),
    "gen-max-tokens-string": _gen("max_new_tokens", "many"),
    "gen-max-tokens-zero": _gen("max_new_tokens", 0),
    "gen-temperature-negative": _gen("temperature", -1),
    "gen-top-p-high": _gen("top_p", 1.5),
    "gen-beams-float": _gen("num_beams", 2.5),
    "gen-stop-not-list": _gen("stop", 5),
    "kv-max-tokens-zero": _place("max_tokens", 0),
    "kv-policy": _place("policy", "evict"),
    "convert-int3": lambda d: _with(d, "load.convert").__setitem__("dtype", "int3"),
    "convert-group-bool": lambda d: _with(d, "load.convert").__setitem__("group_size", True),
    "verify-policy": lambda d: _with(d, "load.verify").__setitem__("hashes", "sometimes"),
    "messages-empty": lambda d: _prompt(d, messages=[]),
    "messages-bad-role": lambda d: _prompt(d, messages=[{"role": "robot", "content": "hi"}]),
    "two-prompt-sources": lambda d: _prompt(d, text="a", messages=[{"role": "user", "content": "b"}]),
}

TEXT_MUTATIONS: dict[str, Callable[[str], str]] = {
    "unclosed-flow": lambda t: t + "\nextra: [1, 2\n",
    "tab-indent": lambda t: t + "\n\tbad: 1\n",
    "python-tag": lambda t: t + "\nevil: !!python/object/apply:os.system ['true']\n",
    "custom-tag": lambda t: t + "\nevil: !secret x\n",
    "duplicate-key": lambda t: t + "\nname: again\n",
    "two-documents": lambda t: t + "\n---\nname: second\n",
    "merge-key": lambda t: "base: &b {a: 1}\n" + t + "\nmerged: {<<: *b}\n",
    "alias-bomb": lambda t: (
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg", strict=True))
        + t
    ),
    "deep-nesting": lambda t: t + "\ndeep: " + "[" * 3000 + "]" * 3000 + "\n",
    "scalar-document": lambda t: "just a string\n",
    "empty": lambda t: "",
    "list-document": lambda t: "- a\n- b\n",
    "binary": lambda t: "\udcff",  # written with surrogateescape: not UTF-8
}


def cases() -> list[tuple[str, Path, str, Any]]:
    out = []
    for plan in PLANS:
        for name, mutation in DATA_MUTATIONS.items():
            out.append((f"{plan.stem}-{name}", plan, "data", mutation))
        for name, mutation in TEXT_MUTATIONS.items():
            out.append((f"{plan.stem}-{name}", plan, "text", mutation))
    return out


CASES = cases()


def test_the_corpus_is_big_enough() -> None:
    assert len(PLANS) >= 6 and len(CASES) >= 150


@pytest.mark.parametrize(("plan", "kind", "mutation"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_plan_is_refused_with_its_position(
    plan: Path, kind: str, mutation: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    text = plan.read_text(encoding="utf-8")
    if kind == "data":
        data = copy.deepcopy(yaml.safe_load(text))
        mutation(data)
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    else:
        text = mutation(text)
    target = tmp_path / "bad.yaml"
    target.write_bytes(text.encode("utf-8", "surrogateescape"))
    monkeypatch.chdir(tmp_path)  # the data home is tmp_path too (tests/conftest.py): nothing lands elsewhere
    code = main(["run", str(target)])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 1, captured.err
    assert lines, "no message"
    for line in lines:
        assert line.startswith(f"{target}:"), line
        assert re.match(rf"{re.escape(str(target))}:\d+:\d+: ", line), line
        assert not EXCEPTION_NAME.search(line), line
    assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"], "something was written"
