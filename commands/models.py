"""`llmplan models`: the models llmplan fetched and imported into its cache, and `llmplan models rm NAME`.

    llmplan models               # name, size on disk, where it came from; the cache folder and the total
    llmplan models rm NAME       # remove one import (and the joined GGUF it was fetched as), nothing else
                                 # or one conversion cache entry, by the name listed for it

What is listed is what llmplan itself made under `$LLMPLAN_CACHE` (~/.cache/llmplan): GGUF imports in
`models/<sha256[:16]>-f<format>-<stem>/` (llm/formats/gguf/importer.py) and the GGUFs joined from PyPI's chunk
packages in `downloads/<sha256[:16]>/` (stages/chunk_packages.py). A model folder of the user's (`--model DIR`)
is never listed or removed: only its first-use hashes are in the cache. `rm` takes a name from the list, never
a path, and refuses anything that is not one of those folders (a link, a file, a name that leaves the cache).
The conversion cache's entries (`conversions/`, llm/formats/conversion_cache) are listed after the models, each
with the model and dtype it holds; removing one only means the next start of its plan converts again.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplan.llm.formats.conversion_cache import EntryInfo, conversions_root, discard_entry, list_entries

IMPORT_DIR = re.compile(r"^(?P<digest>[0-9a-f]{16})-f(?P<format>\d+)-(?P<stem>.+)$")


def register(subparsers: Any) -> None:
    models = subparsers.add_parser(
        "models",
        help="list the models llmplan fetched and imported (sizes, origins); `models rm NAME` removes one",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    models.add_argument("action", nargs="?", choices=["list", "rm"], default="list", help="list (default) or rm")
    models.add_argument("name", nargs="?", help="rm: the model's name, as `llmplan models` lists it")
    models.add_argument("--json", action="store_true", help="list: one JSON object per model per line")
    models.set_defaults(handler=cmd_models, needs_stages=False)  # a folder listing: no torch


@dataclass
class CachedModel:
    name: str  # the GGUF's stem: what `rm` takes
    folder: Path  # the import
    download: Path | None  # the joined GGUF's folder, when it was fetched in pieces
    size: int  # bytes on disk, the import and the download together
    origin: str

    def to_dict(self) -> dict[str, Any]:
        download = str(self.download) if self.download else None
        return {"name": self.name, "path": str(self.folder), "download": download, "bytes": self.size} | {
            "from": self.origin
        }


def cmd_models(args: argparse.Namespace) -> int:
    from llmplan.cache_home import cache_home
    from llmplan.engine.cli import CliError

    root = cache_home()
    found = cached_models(root)
    conversions = list_entries(conversions_root())
    if args.action == "rm":
        if not args.name:
            raise CliError("models rm: give a model's name (`llmplan models` lists them)")
        if any(entry.name == args.name for entry in conversions):
            return remove_conversion(next(e for e in conversions if e.name == args.name))
        return remove(root, found, args.name)
    if args.name:
        raise CliError(f"models: unexpected {args.name!r} (did you mean `llmplan models rm {args.name}`?)")
    if args.json:
        for model in found:
            print(json.dumps(model.to_dict()))
        for entry in conversions:
            print(json.dumps(conversion_row(entry)))
        return 0
    for model in found:
        print(f"{model.name}  {size_text(model.size)}  from {model.origin}")
    for entry in conversions:
        print(f"{entry.name}  {size_text(entry.bytes)}  conversion of {entry.model} to {entry.dtype}, {entry.created}")
    total = size_text(sum(m.size for m in found) + sum(e.bytes for e in conversions))
    counts = f"{len(found)} model(s), {len(conversions)} conversion(s)"
    print(f"{counts}, {total} in {root} ($LLMPLAN_CACHE)", file=sys.stderr)
    return 0


def conversion_row(entry: EntryInfo) -> dict[str, Any]:
    return {"name": entry.name, "path": str(entry.path), "bytes": entry.bytes, "kind": "conversion"} | {
        "model": entry.model,
        "dtype": entry.dtype,
        "created": entry.created,
    }


def remove_conversion(entry: EntryInfo) -> int:
    """One conversion cache entry, moved aside and deleted: its plan's next start converts again."""
    from llmplan.engine.cli import CliError

    if not discard_entry(entry.path):
        raise CliError(f"models rm: {entry.path} could not be moved aside; left as it was")
    print(f"removed {entry.name}: {entry.path} ({size_text(entry.bytes)}); the next start of its plan converts again")
    return 0


def cached_models(root: Path) -> list[CachedModel]:
    """Every finished import under root/models (an unfinished one is a dotfile and skipped), by name."""
    from llmplan.stages.chunk_packages import DOWNLOADS_DIR
    from llmplan.stages.model_source import default_cache_dir

    imports = default_cache_dir()
    try:
        entries = sorted(imports.iterdir())
    except OSError:
        return []
    out = []
    for folder in entries:
        match = IMPORT_DIR.match(folder.name)
        if match is None or folder.is_symlink() or not folder.is_dir():
            continue
        download = root / DOWNLOADS_DIR / match["digest"]
        download = download if download.is_dir() and not download.is_symlink() else None
        size = disk_size(folder) + (disk_size(download) if download else 0)
        out.append(CachedModel(match["stem"], folder, download, size, origin_of(folder, download)))
    return out


def origin_of(folder: Path, download: Path | None) -> str:
    """Where an import came from: its record (stages/model_source.py `record_origin`), else what the cache shows."""
    from llmplan.stages.model_source import origin_record

    try:
        data = json.loads(origin_record(folder).read_text(encoding="utf-8"))
        said = str(data["from"])
    except (OSError, ValueError, KeyError, TypeError):
        said = "a GGUF imported before llmplan noted origins"
    if download is not None:
        said += f"; the joined GGUF kept in {download}"
    return said


def disk_size(folder: Path) -> int:
    """Bytes the folder's regular files take (links are not followed: a link's target is not ours)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.lstat().st_size
        except OSError:
            continue
    return total


def size_text(size: int) -> str:
    for unit, power in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << power:
            return f"{size / (1 << power):.1f} {unit}"
    return f"{size} B"


def remove(root: Path, found: list[CachedModel], name: str) -> int:
    """Remove the import named `name` (and its download); anything else is refused in one line."""
    from llmplan.engine.cli import CliError
    from llmplan.engine.messages import suggest
    from llmplan.stages.model_source import origin_record

    chosen = [m for m in found if name in (m.name, m.folder.name)]
    if not chosen:
        known = ", ".join(m.name for m in found) or "none"
        hint = suggest(name, [m.name for m in found])
        raise CliError(f"models rm: {name!r} is not a model in {root}; refused{hint} (known: {known})")
    if len(chosen) > 1:
        folders = ", ".join(m.folder.name for m in chosen)
        raise CliError(f"models rm: {name!r} names {len(chosen)} imports; give one of {folders}")
    model = chosen[0]
    for folder in (model.folder, model.download):
        if folder is not None and folder.resolve().parent.parent != root.resolve():
            raise CliError(f"models rm: {folder} is outside the cache {root}; refused")
    shutil.rmtree(model.folder)
    if model.download is not None:
        shutil.rmtree(model.download)
    origin_record(model.folder).unlink(missing_ok=True)
    print(f"removed {model.name}: {model.folder} ({size_text(model.size)})")
    return 0
