"""The peak while loading, predicted for `validate --deep`: what load.shard_stream and load.convert hold at once.

The stream clones each shard's wanted tensors out of its mapping (llm/formats/shard_reader.py), so while a shard is
read its mapped pages and its clone are both resident; up to `buffer_shards` cloned shards wait for the
converter. The converter keeps what it has converted, and the source parts of a fused tensor (q, k, v;
gate, up) until the last part arrives. The peak is the largest of those sums over the shards, in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmplan.llm.trust import IntegrityError, ShardManifest, read_safetensors_header

_ELEMENT = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def shard_tensor_bytes(manifest: ShardManifest, wanted: set[str]) -> list[dict[str, int]] | None:
    """Each shard's wanted tensors and their bytes as stored, in read order; None when the headers cannot
    say (a pickle has no header; a damaged one is reported by load.shard_stream's own check)."""
    if manifest.format != "safetensors":
        return None
    shards = []
    for shard in manifest.shards:
        try:
            header = read_safetensors_header(shard.path)
        except IntegrityError:
            return None
        sizes = {}
        for name, entry in header.tensors.items():
            if name in wanted:
                count = 1
                for d in entry["shape"]:
                    count *= int(d)
                sizes[name] = count * _ELEMENT.get(entry["dtype"], 4)
        if sizes:  # a shard with nothing wanted is never opened
            shards.append(sizes)
    return shards


def converting_peak(
    shards: Sequence[Mapping[str, int]],
    table: Mapping[str, Sequence[str]],
    converted: Mapping[str, int],
    buffer_shards: int,
) -> int:
    """Bytes resident at the worst moment of the streamed conversion.

    `table` maps each converted tensor to its source parts (llm/model/weights.py fusion_table), `converted` gives
    each converted tensor's bytes (0 for one that shares another's storage, as a tied fp32 head does).
    """
    arrived: set[str] = set()
    done: set[str] = set()
    sizes = [sum(s.values()) for s in shards]
    peak = 0
    for i, shard in enumerate(shards):
        ahead = sizes[i : i + buffer_shards]
        kept = sum(converted[name] for name in done)
        waiting = sum(size for s in shards[:i] for name, size in s.items() if _still_needed(name, table, done))
        # the clones of the shards in the buffer, and the pages of the last one, mapped while it is read
        peak = max(peak, kept + waiting + sum(ahead) + ahead[-1])
        arrived |= shard.keys()
        done |= {name for name, parts in table.items() if all(p in arrived for p in parts)}
    return max(peak, sum(converted.values()))


def _still_needed(source: str, table: Mapping[str, Sequence[str]], done: set[str]) -> bool:
    return any(source in parts and name not in done for name, parts in table.items())
