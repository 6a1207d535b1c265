"""The report's picture of a format's mask: one panel per request that ran under a format, none otherwise."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from llmplan.commands.report.figures_format import draw_format_mask


def test_the_mask_is_drawn_per_step_for_shaped_requests_only(tmp_path: Path) -> None:
    shaped = {
        "request_id": "shaped",
        "format": {"kind": "json_schema", "summary": "object {n}"},
        "mask_allowed": [1, 1, 1, 11, 11, 2, 1, 1],
    }
    free = {"request_id": "free", "format": None, "mask_allowed": None}
    (figure,) = draw_format_mask(SimpleNamespace(generations=[free, shaped]), tmp_path)  # type: ignore[arg-type]
    svg = figure.path.read_text(encoding="utf-8")
    assert figure.key == "format" and "shaped: json_schema (object {n}), 8 steps, 5 with one token allowed" in svg
    assert "free" not in svg
    assert draw_format_mask(SimpleNamespace(generations=[free]), tmp_path / "none") == []  # type: ignore[arg-type]
