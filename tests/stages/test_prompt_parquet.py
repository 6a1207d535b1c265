"""Parquet prompt sets: the JSONL fields as columns, read into the same requests as the JSONL lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmplan.engine.findings import StageFailure
from llmplan.stages.compute_tokenize import read_prompts

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS: list[dict[str, Any]] = [
    {"id": "a", "messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 4},
    {"id": "b", "text": "raw prompt", "temperature": 0.5},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]},
]


def _table(rows: list[dict[str, Any]]) -> Any:
    """The columns a prompt set has; a field a row does not give is null there."""
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("messages", pa.list_(message)),
            ("text", pa.string()),
            ("max_new_tokens", pa.int64()),
            ("temperature", pa.float64()),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema)


class Log:
    def warning(self, *args: Any, **kwargs: Any) -> None:
        pass


def _lines(rows: list[tuple[int, Any]]) -> list[tuple[int, dict[str, Any]]]:
    return [(n, line.model_dump(exclude_none=True)) for n, line in rows]


def test_parquet_reads_as_the_same_jsonl(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    parquet = tmp_path / "p.parquet"
    pq.write_table(_table(ROWS), parquet)
    assert _lines(read_prompts(parquet, "skip", Log())) == _lines(read_prompts(jsonl, "skip", Log()))


def test_a_bad_row_is_a_notice_naming_file_and_row(tmp_path: Path) -> None:
    parquet = tmp_path / "p.parquet"
    both = {"id": "both", "text": "x", "messages": [{"role": "user", "content": "y"}]}
    pq.write_table(_table([*ROWS, both]), parquet)
    notices: list[tuple[str, str]] = []
    rows = read_prompts(parquet, "skip", Log(), lambda kind, message: notices.append((kind, message)))
    assert [n for n, _ in rows] == [1, 2, 3]
    assert notices == [
        ("skipped_line", f"{parquet}:4: row: give exactly one of `messages` or `text`; row skipped (on_bad_line: skip)")
    ]
    with pytest.raises(StageFailure, match=f"{parquet}:4: "):
        read_prompts(parquet, "fail", Log())


def test_not_parquet_is_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "p.parquet"
    fake.write_text("not parquet", encoding="utf-8")
    with pytest.raises(StageFailure, match=r"p\.parquet: not a readable Parquet file"):
        read_prompts(fake, "skip", Log())
