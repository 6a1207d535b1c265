"""Where llmplan keeps its own files: `$LLMPLAN_CACHE`, or `~/.cache/llmplan` (imports, kernels, the hash key).

Shared by every layer (the library's hash cache and GGUF import, the stages' model source): one rule, stated once.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    root = os.environ.get("LLMPLAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmplan")
    return Path(root)


def settle_matplotlib_home() -> None:
    """Point matplotlib's config and font cache (MPLCONFIGDIR) at llmplan's cache home, not $HOME, unless the
    user chose a place. Called before matplotlib is imported: it reads the variable once, at import."""
    if not os.environ.get("MPLCONFIGDIR"):
        os.environ["MPLCONFIGDIR"] = str(cache_home() / "matplotlib")
