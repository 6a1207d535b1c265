"""The committed plan.schema.json (what editors use through yaml-language-server) is current."""

from __future__ import annotations

import json
from pathlib import Path

from llmplan.engine.registry import discover
from llmplan.engine.schema import plan_schema

SCHEMA = Path(__file__).resolve().parents[2] / "plan.schema.json"


def test_committed_schema_matches_the_installed_stages() -> None:
    current = plan_schema(discover())
    assert json.loads(SCHEMA.read_text(encoding="utf-8")) == current, (
        "plan.schema.json is stale: run `llmplan schema > plan.schema.json`"
    )


def test_schema_knows_every_shipped_stage() -> None:
    text = SCHEMA.read_text(encoding="utf-8")
    for name in ("compute.generate", "load.convert", "output.write", "cache.lookup"):
        assert f'"const": "{name}"' in text, name
