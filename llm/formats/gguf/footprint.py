"""How far a GGUF import's resident weights are from the GGUF's own size, and why, from the real tensors.

A K-quant GGUF (Q4_K_M: 4.5-6.6 bits a weight) is dequantized on import and re-quantized to the plan's
dtype, and the embedding table stays a float table (a row gather needs no matmul kernel; on the CPU it is
fp32), so the resident weights are a multiple of the file. The memory tables (the report's "Memory:
predicted and measured", `llmplan bench`'s memory lines) say by how much, split where the difference
comes from: the embeddings, the head (a second, quantized copy where the file ties it to the embeddings),
the other matrices, the vectors, and the file's vocabulary and metadata (no resident weight at all).

Two halves: `resident_parts` at load time (the tensors are there, and it costs nothing), `gguf_footprint`
when a table is drawn (parsing a 262k-token vocabulary's header takes most of a second, which a timed load
should not pay).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .file import open_gguf
from .file_type import gguf_type_of

EMBEDDINGS, HEAD = "tok_embeddings.weight", "output.weight"  # internal names (llm/model/weights.py)
GGUF_EMBEDDINGS, GGUF_HEAD = "token_embd.weight", "output.weight"
PARTS = ("embeddings", "head", "matrices", "vectors")
_FLOATS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def held_as(weight: Any) -> str:
    """The format a resident weight is held in: fp32 / fp16 / bf16 / int8 / int4."""
    from ...model.weight_formats import GGUFParts, GGUFWeight, Int4Weight, Int8Weight  # torch: here (footprint_line)

    if isinstance(weight, GGUFWeight):  # dtype stored: the file's own blocks
        return weight.type_name
    if isinstance(weight, GGUFParts):
        return "/".join(dict.fromkeys(p.type_name for p in weight.parts))
    if isinstance(weight, Int8Weight):
        return "int8"
    if isinstance(weight, Int4Weight):
        return "int4"
    name = str(weight.dtype).removeprefix("torch.")
    return _FLOATS.get(name, name)


def _formats(parts: dict[str, int]) -> str:
    """{"Q5_0": 43M, "Q4_K": 13M} -> "Q5_0/Q4_K", the most bytes first."""
    return "/".join(name for name, _ in sorted(parts.items(), key=lambda item: -item[1])) or "-"


def resident_parts(tensors: dict[str, Any]) -> dict[str, Any]:
    """The resident `tensors` (load.convert's, internal names) by part: bytes and formats. Cheap (no file
    read), so load.to_device records it inside the timed load; the file's side is read by the tables."""
    from torch import Tensor

    from ...model.weight_formats import nbytes

    resident: dict[str, int] = {part: 0 for part in PARTS}
    held: dict[str, set[str]] = {part: set() for part in PARTS}
    seen: set[int] = set()
    tied = False
    for name, weight in tensors.items():
        key = weight.data_ptr() if isinstance(weight, Tensor) else id(weight)  # a GGUF table: by object
        if key in seen:  # the tied head is the embedding table itself: counted once
            tied = tied or name == HEAD
            continue
        seen.add(key)
        part = "embeddings" if name == EMBEDDINGS else "head" if name == HEAD else None
        part = part or ("vectors" if isinstance(weight, Tensor) and weight.dim() < 2 else "matrices")
        resident[part] += weight.nbytes if isinstance(weight, Tensor) else nbytes(weight)
        held[part].update(held_as(weight).split("/"))  # fused GGUF parts: each block type once
    return {
        "parts": {part: {"bytes": resident[part], "as": "/".join(sorted(held[part])) or "-"} for part in PARTS},
        "head_shares_embeddings": tied,
    }


def gguf_footprint(path: Path, resident: dict[str, Any]) -> dict[str, Any]:
    """`resident_parts`' figures against the GGUF at `path` they came from (its header and tensor table
    read: GGUFFileError or OSError when it is no longer there or no longer a GGUF)."""
    with open_gguf(Path(path)) as gguf:
        kind = gguf_type_of(gguf)
        file_tensors = dict(gguf.tensors)
    in_file: dict[str, dict[str, int]] = {part: {} for part in PARTS}
    for name, tensor in file_tensors.items():
        part = "embeddings" if name == GGUF_EMBEDDINGS else "head" if name == GGUF_HEAD else None
        part = part or ("matrices" if len(tensor.dims) >= 2 else "vectors")
        in_file[part][tensor.type_name] = in_file[part].get(tensor.type_name, 0) + tensor.nbytes
    mine = resident["parts"]
    weights = sum(mine[part]["bytes"] for part in PARTS)
    tensor_bytes = sum(sum(p.values()) for p in in_file.values())
    return {
        "gguf_file": Path(path).name,
        "gguf_type": kind.name,
        "gguf_bytes": kind.file_bytes,
        "weights_bytes": weights,
        "ratio": weights / kind.file_bytes if kind.file_bytes else None,
        "parts": {
            part: {
                "resident_bytes": mine[part]["bytes"],
                "resident_as": mine[part]["as"],
                "gguf_bytes": sum(in_file[part].values()),
                "gguf_as": _formats(in_file[part]),
            }
            for part in PARTS
        },
        "gguf_metadata_bytes": kind.file_bytes - tensor_bytes,  # the vocabulary, merges, chat template, header
        "head_tied_in_gguf": GGUF_HEAD not in file_tensors,
        "head_shares_embeddings": resident["head_shares_embeddings"],
    }


def read_per_token(resident: dict[str, Any]) -> int:
    """The resident bytes a batch-1 decode step reads (`resident_parts`' record): every matrix and vector and
    the head, but of the embeddings one row (nothing, at this scale) unless the head is the table itself."""
    parts = resident["parts"]
    table = parts["embeddings"]["bytes"] if resident.get("head_shares_embeddings") else 0
    return parts["matrices"]["bytes"] + parts["vectors"]["bytes"] + parts["head"]["bytes"] + table


def gguf_read_per_token(path: Path) -> int:
    """The same for llama.cpp running the GGUF at `path`: every tensor but `token_embd`, which a file without
    `output.weight` reads as its head too (GGUFFileError or OSError as `open_gguf`)."""
    with open_gguf(Path(path)) as gguf:
        tensors = dict(gguf.tensors)
    tied = GGUF_HEAD not in tensors
    return sum(t.nbytes for name, t in tensors.items() if name != GGUF_EMBEDDINGS or tied)


def recorded_footprint(metric: dict[str, Any] | None) -> dict[str, Any] | None:
    """The footprint from load.to_device's `resident_weights` metric (None: not a GGUF import, or the file
    cannot be read any more: then there is no line rather than a wrong one)."""
    if not metric or not metric.get("gguf_file"):
        return None
    try:
        return gguf_footprint(Path(metric["gguf_file"]), metric)
    except (OSError, ValueError):  # GGUFFileError is a ValueError
        return None


def footprint_line(fp: dict[str, Any], mib: Any) -> str:
    """One line for a memory table: the ratio, then where it comes from (each part's bytes and formats)."""
    parts = fp["parts"]
    emb, head, mat = parts["embeddings"], parts["head"], parts["matrices"]
    floats = set(mat["resident_as"].split("/")) <= set(_FLOATS.values())
    requantized = f" to {mat['resident_as']}" if floats else f" and re-quantized to {mat['resident_as']}"
    same = [set(part["resident_as"].split("/")) == set(part["gguf_as"].split("/")) for part in (mat, emb)]
    stored = all(same)  # load.convert `stored`: the file's own types (each part's names in either order)
    kept = "rows gathered from the file's own table" if stored else f"kept {emb['resident_as']} for the row gathers"
    made = "the file's own blocks, mapped" if stored else f"the file's blocks dequantized{requantized}"
    line = (
        f"weights {mib(fp['weights_bytes'])} = {fp['ratio']:.2f}x the GGUF's {mib(fp['gguf_bytes'])} "
        f"({fp['gguf_type']}): embeddings {mib(emb['resident_bytes'])} {emb['resident_as']} against "
        f"{mib(emb['gguf_bytes'])} {emb['gguf_as']} in the file ({kept})"
        f"; the linears {mib(mat['resident_bytes'])} {mat['resident_as']} against {mib(mat['gguf_bytes'])} "
        f"{mat['gguf_as']} ({made})"
    )
    own = f"; the head {mib(head['resident_bytes'])} {head['resident_as']}"
    if head["resident_bytes"] and fp["head_tied_in_gguf"]:
        line += f"{own}, a copy the file ties to its embeddings"
    elif head["resident_bytes"]:
        line += f"{own} against {mib(head['gguf_bytes'])} {head['gguf_as']}"
    elif fp["head_shares_embeddings"]:
        line += "; the head is the embedding table itself"
    return line + f"; the file's vocabulary and metadata {mib(fp['gguf_metadata_bytes'])} are not weights"
