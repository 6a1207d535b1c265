"""The report of a run: pictures of the plan, the data flow, the model, memory, layers, attention, generation.

`build_report(run_dir)` writes RUN_DIR/report/*.svg and a self-contained RUN_DIR/report/index.html.
"""

from __future__ import annotations

from .build import build_report

__all__ = ["build_report"]
