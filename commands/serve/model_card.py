"""What `/v1/models` says about the served model: its own name (not the plan's), its aliases, the plan as metadata.

The model's id is the name its user knows it by, the one `history` and `show` say (ModelSource.name): a GGUF's
file stem (`qwen2.5-coder-0.5b-instruct-q4_k_m`, not its `general.name`, which may name another quantization:
"Qwen2.5 Coder 0.5B Instruct AWQ" for a Q4_K_M), an HF directory's name (a Hub snapshot's repository). The
GGUF's `general.name`, an HF config's `_name_or_path` (the last part) and the plan's name are aliases: a server
started with `--strict-model` answers to those and the id only;
otherwise every name is accepted, as llama-server does (clients send `gpt-4o-mini` by default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplan.llm.formats.gguf import GGUFFileError, open_gguf

NAME_CHARS = 256  # a requested name is echoed back up to this length (OpenAI's ids are far shorter)


@dataclass(frozen=True)
class ModelCard:
    id: str
    aliases: tuple[str, ...]
    plan: str
    created: int
    embeddings: dict[str, Any] | None = None  # how /v1/embeddings makes its vectors: pooling, normalization, width

    def answers_to(self, name: str) -> bool:
        return name == self.id or name in self.aliases

    def shown_name(self, requested: str | None) -> str:
        """The `model` of a response: the name the client asked for (clients compare it), else the id."""
        if requested is not None and 0 < len(requested) <= NAME_CHARS:
            return requested
        return self.id

    def entry(self) -> dict[str, Any]:
        """One `/v1/models` entry: OpenAI's four keys, the plan under `llmplan` (a key OpenAI's SDK keeps)."""
        return {
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": "llmplan",
            "llmplan": {"plan": self.plan, "aliases": list(self.aliases)}
            | ({"embeddings": self.embeddings} if self.embeddings is not None else {}),
        }


def model_card(source: Any, plan_name: str, created: int, embeddings: dict[str, Any] | None = None) -> ModelCard:
    """The card of the model at `source` (a `ModelSource`, or None before any load); `embeddings`: how the
    server's /v1/embeddings vectors are made."""
    names: list[str] = [source.name] if source is not None else []
    gguf = getattr(source, "gguf_file", None)
    if gguf is not None:
        names += [n for n in (_gguf_name(Path(gguf)),) if n]
    model_dir = getattr(source, "model_dir", None)
    if model_dir is not None and gguf is None:  # an imported GGUF's directory is the cache's (a hash in its name)
        names += [n for n in (_config_name(Path(model_dir)),) if n]
    names.append(plan_name)
    unique = list(dict.fromkeys(names))
    return ModelCard(unique[0], tuple(unique[1:]), plan_name, created, embeddings)


def _gguf_name(path: Path) -> str | None:
    try:
        with open_gguf(path) as gguf:
            name = gguf.metadata.get("general.name")
    except (GGUFFileError, OSError):
        return None
    return name.strip() or None if isinstance(name, str) else None


def _config_name(model_dir: Path) -> str | None:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("_name_or_path") if isinstance(config, dict) else None
    return name.rstrip("/").rsplit("/", 1)[-1] or None if isinstance(name, str) else None
