"""A mapped GGUF's weights under the model's internal names, linear weights and embeddings as the file's blocks.

Why: the model then runs on the bytes the file holds (llm/model's GGUFLinear, GGUFEmbedding), with none of
the fp32 import's memory or re-quantization; only the small tensors (norms, biases) become fp32.

The names and checks are the importer's (hf_config.py: the family's config, every tensor's HF name and shape
checked), and what it undoes of llama.cpp's convert is undone here too, exactly:
  * Llama's q/k rows permuted per head: rows are whole blocks, so the rows are put back in HF order by a
    gather of block rows (a copy of q and k; no other family permutes);
  * Gemma's norms stored as 1 + w: fp32, shifted as the import shifts them.
Fused groups (q/k/v -> wqkv, gate/up -> w13) join their block rows where the parts share a type, else stay
parts that compute their own rows (Q4_K_M files keep v and down in Q6_K): `fuse_gguf`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...model.config import ModelConfig
from ...model.layer_names import is_linear_weight
from ...model.weight_formats import GGUFParts, GGUFWeight, dequantize_gguf, fuse_gguf
from ...model.weights import fusion_table
from .file import GGUFFile, GGUFFileError, TensorInfo
from .hf_config import Planned, family_of, hf_config, plan_tensors
from .importer import unpermute_rope_rows
from .mapped import MappedGGUF, whole_pages
from .metadata import GGUFMetadata

EMBEDDINGS = "tok_embeddings.weight"


def stored_config(mapped: MappedGGUF) -> dict[str, Any]:
    """The HF config.json of the file (the importer's, checked by the same rules)."""
    meta = GGUFMetadata(mapped.file)
    return hf_config(meta, family_of(meta), mapped.file.tensors)


def stored_weights(mapped: MappedGGUF) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, internal name -> weight): linear weights and the embedding table `GGUFWeight`s (views on the
    mapping, or parts of them), norms and biases fp32 tensors; a tied head is the embedding's very object."""
    cfg, planned = _planned(mapped.file)
    out: dict[str, Any] = {}
    for internal, parts in fusion_table(cfg).items():
        if internal == "output.weight" and cfg.tie_word_embeddings:
            out[internal] = out[EMBEDDINGS]  # one table: the tied head multiplies by the same blocks
        elif is_linear_weight(internal) or internal == EMBEDDINGS:
            out[internal] = fuse_gguf([_blocks(mapped, planned[p]) for p in parts])
            # the copy is what the model reads: the pages it came from go back at once (a load holds each once)
            mapped.release(_copied([planned[p] for p in parts], out[internal]))
        else:
            values = [_floats(mapped, planned[p]) for p in parts]
            out[internal] = values[0] if len(values) == 1 else torch.cat(values)
    return cfg, out


def _copied(parts: list[Planned], fused: GGUFWeight | GGUFParts) -> list[str]:
    """The file's tensors a weight holds copies of rather than views: all of a joined group, a reordered q/k."""
    if len(parts) > 1 and isinstance(fused, GGUFWeight):
        return [p.gguf_name for p in parts]
    return [p.gguf_name for p in parts if p.unpermute_heads is not None]


def copied_bytes(file: GGUFFile) -> int:
    """Bytes `stored_weights` copies out of the mapping, from the header alone: fused groups of one block type
    (joined rows), and Llama's q/k rows put back in order where they stay parts."""
    return copies(file)[0]


def copies(file: GGUFFile) -> tuple[int, int]:
    """(the bytes copied, the whole pages of those tensors the load gives back after copying them), in one pass
    over the header: a load holds the mapping plus the one less the other (what `validate --deep` predicts)."""
    infos = _copied_infos(file)
    return sum(i.nbytes for i in infos), sum(max(0, end - start) for start, end in map(whole_pages, infos))


def _copied_infos(file: GGUFFile) -> list[TensorInfo]:
    cfg, planned = _planned(file)
    out: list[TensorInfo] = []
    for internal, parts in fusion_table(cfg).items():
        tied = internal == "output.weight" and cfg.tie_word_embeddings
        if tied or not (is_linear_weight(internal) or internal == EMBEDDINGS):
            continue
        infos = [file.tensors[planned[p].gguf_name] for p in parts]
        kinds = {(info.ggml_type, info.nbytes // (info.dims[1] if len(info.dims) == 2 else 1)) for info in infos}
        if len(parts) > 1 and len(kinds) == 1:
            out += infos  # fuse_gguf's torch.cat
        else:
            out += [i for i, p in zip(infos, parts, strict=True) if planned[p].unpermute_heads is not None]
    return out


def _planned(file: GGUFFile) -> tuple[ModelConfig, dict[str, Planned]]:
    """The model's config and each HF tensor's plan (its GGUF name, shape, what to undo), from the header."""
    meta = GGUFMetadata(file)
    family = family_of(meta)
    config = hf_config(meta, family, file.tensors)
    planned = {p.hf_name: p for p in plan_tensors(family, file.tensors, config, file.path)}
    return ModelConfig.from_hf_dict(config), planned


def _blocks(mapped: MappedGGUF, planned: Planned) -> GGUFWeight:
    weight = mapped.tensors[planned.gguf_name].weight()
    if planned.unpermute_heads is None:
        return weight
    order = unpermute_rope_rows(np.arange(weight.shape[0]), planned.unpermute_heads)
    return weight.rows(torch.from_numpy(np.ascontiguousarray(order)))


def _floats(mapped: MappedGGUF, planned: Planned) -> Tensor:
    """A small tensor (a norm, a bias) as fp32 in its HF shape; NaN or infinity refused naming it."""
    values = dequantize_gguf(mapped.tensors[planned.gguf_name].weight()).reshape(planned.hf_shape)
    if not bool(torch.isfinite(values).all()):
        raise GGUFFileError(f"{mapped.path}: tensor {planned.gguf_name} holds NaN or infinite values; refused")
    return values - planned.norm_shift if planned.norm_shift else values


def stored_types(weights: dict[str, Any]) -> dict[str, int]:
    """Bytes of the file's blocks the model holds, by block type ("Q4_K": ...), each tensor counted once."""
    seen: set[int] = set()
    by_type: dict[str, int] = {}
    for weight in weights.values():
        for part in getattr(weight, "parts", (weight,)):
            if not isinstance(part, GGUFWeight) or id(part) in seen:
                continue
            seen.add(id(part))
            name = part.type_name or str(part.qtype)
            by_type[name] = by_type.get(name, 0) + part.nbytes
    return dict(sorted(by_type.items(), key=lambda item: -item[1]))
