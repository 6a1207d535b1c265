"""A GGUF mapped as stored (llm/formats/gguf/mapped.py): views on the file's bytes, no copy; hostile tensors
refused in one line naming the tensor; the once-per-file scale check."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from tiny_gguf import random_blocks

from llmplan.llm.formats.gguf import GGUFFileError, open_gguf
from llmplan.llm.formats.gguf.block_types import BY_NAME
from llmplan.llm.formats.gguf.file import TensorInfo
from llmplan.llm.formats.gguf.mapped import check_block_values, check_tensor, map_gguf


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _mixed(path: Path) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    _write(
        path,
        {
            "a.q8": (quantize(w, Q.Q8_0), Q.Q8_0),
            "b.q4_0": (quantize(w, Q.Q4_0), Q.Q4_0),
            "c.q4_k": (random_blocks("Q4_K", 4, 512, seed=2), Q.Q4_K),
            "d.q6_k": (random_blocks("Q6_K", 3, 256, seed=3), Q.Q6_K),
            "e.f32": (rng.standard_normal(64).astype(np.float32), Q.F32),
            "f.f16": (rng.standard_normal((2, 32)).astype(np.float16), Q.F16),
        },
    )


def test_views_are_the_files_bytes_without_a_copy(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    _mixed(path)
    with open_gguf(path) as parsed, map_gguf(path) as mapped:
        assert sorted(mapped.tensors) == sorted(parsed.tensors)
        storages = {t.blocks.untyped_storage().data_ptr() for t in mapped.tensors.values()}
        assert len(storages) == 1  # one mapping, every tensor a view on it
        for name, info in parsed.tensors.items():
            view = mapped.tensors[name]
            assert view.type_name == info.type_name and view.shape == info.shape and view.nbytes == info.nbytes
            assert bytes(view.blocks.reshape(-1).numpy()) == bytes(
                np.ascontiguousarray(parsed.read(info)).view(np.uint8)
            )
        q4k = mapped.tensors["c.q4_k"]
        assert tuple(q4k.blocks.shape) == (4, 2 * 144)
        weight = q4k.weight()
        assert weight.shape == (4, 512) and weight.qtype == 12 and weight.blocks.data_ptr() == q4k.blocks.data_ptr()
        assert mapped.tensors["e.f32"].weight().shape == (1, 64)
    assert path.read_bytes()[:4] == b"GGUF"  # a private mapping: the file is never written


def test_a_type_without_a_kernel_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "q3k.gguf"
    raw = np.zeros((2, 110), dtype=np.uint8)  # Q3_K: 256 columns in 110 bytes
    _write(path, {"ok": (np.ones(32, dtype=np.float32), Q.F32), "blk.0.ffn_down.weight": (raw, Q.Q3_K)})
    with pytest.raises(GGUFFileError) as info:
        map_gguf(path)
    message = str(info.value)
    assert "\n" not in message and "blk.0.ffn_down.weight" in message and "Q3_K" in message
    assert "needs conversion" in message and str(path) in message


def _info(name: str, type_name: str, dims: tuple[int, ...], offset: int, nbytes: int) -> TensorInfo:
    return TensorInfo(name, BY_NAME[type_name].ggml_type, type_name, dims, offset, nbytes)


@pytest.mark.parametrize(
    ("info", "said"),
    [
        (_info("past.end", "Q8_0", (64, 2), 900, 136), "past the end"),
        (_info("part.block", "Q8_0", (48, 2), 0, 102), "not whole Q8_0 blocks"),
        (_info("short.rows", "Q4_K", (256, 2), 0, 144), "not whole Q4_K blocks"),
        (_info("cube", "F32", (4, 4, 4), 0, 256), "3 dimensions"),
    ],
)
def test_each_tensor_is_checked_against_what_the_kernels_read(info: TensorInfo, said: str) -> None:
    with pytest.raises(GGUFFileError) as bad:
        check_tensor(Path("m.gguf"), info, 1000)
    assert said in str(bad.value) and info.name in str(bad.value) and "\n" not in str(bad.value)


def test_overlap_and_truncation_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    _mixed(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-64])  # the last tensor's bytes run past the end
    with pytest.raises(GGUFFileError, match=r"tensor f\.f16: .*past the end"):
        map_gguf(cut)
    with open_gguf(path) as parsed:
        second = parsed.tensors["b.q4_0"]
    # point b.q4_0's offset (relative to the data section) at a.q8's bytes: an overlap
    rel = (second.offset - parsed.data_offset).to_bytes(8, "little")
    at = data.index(b"b.q4_0")
    offset_at = data.index(rel, at)
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(data[:offset_at] + (0).to_bytes(8, "little") + data[offset_at + 8 :])
    with pytest.raises(GGUFFileError, match=r"a\.q8 and b\.q4_0 overlap|b\.q4_0.*overlap"):
        map_gguf(bad)


def test_block_values_are_checked_once_naming_tensor_and_block(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    _mixed(path)
    with map_gguf(path) as mapped:
        assert check_block_values(mapped) == 8 * 8 + 8 * 8 + 4 * 2 + 3 + 64 + 64
    for tensor, offset, block in (("c.q4_k", 2, 5), ("d.q6_k", 208, 1), ("a.q8", 0, 9)):
        damaged = tmp_path / f"nan-{tensor}.gguf"
        raw = bytearray(path.read_bytes())
        with open_gguf(path) as parsed:
            info = parsed.tensors[tensor]
        size = BY_NAME[info.type_name].type_size
        at = info.offset + block * size + offset
        raw[at : at + 2] = np.array([np.inf], dtype=np.float16).tobytes()
        damaged.write_bytes(bytes(raw))
        with map_gguf(damaged) as mapped, pytest.raises(GGUFFileError) as bad:
            check_block_values(mapped)
        assert f"tensor {tensor}: block {block} has a NaN or infinite fp16 scale" in str(bad.value)
    nan_float = tmp_path / "nan-f16.gguf"
    raw = bytearray(path.read_bytes())
    with open_gguf(path) as parsed:
        info = parsed.tensors["f.f16"]
    raw[info.offset + 6 : info.offset + 8] = np.array([np.nan], dtype=np.float16).tobytes()
    nan_float.write_bytes(bytes(raw))
    with map_gguf(nan_float) as mapped, pytest.raises(GGUFFileError, match=r"tensor f\.f16: value 3 is NaN"):
        check_block_values(mapped)


def test_close_drops_the_views(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    _mixed(path)
    mapped = map_gguf(path)
    kept = mapped.tensors["a.q8"].blocks
    mapped.close()
    assert mapped.tensors == {}
    assert torch.equal(kept[:1], kept[:1].clone())  # a view kept elsewhere stays valid
