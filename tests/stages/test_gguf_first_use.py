"""A GGUF runs as stored (#54): the first use of a plan that keeps the file's blocks writes only what cannot be
read in place (config, tokenizer, the pin of the GGUF), never fp32 shards; later starts read no shard and do not
check the blocks again; a changed file and a damaged block scale are refused in one line; a converting plan on
the same file still gets its shards, on its own first use.

The tiny GGUF is tests/llm/tiny_gguf.py's (Qwen2, Q4_K/Q6_K linears, a tied Q8_0 table), run through
`llmplan run --model FILE` with the fp32 plan (greedy) and `convert.dtype=stored`, and with no plan at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmplan.engine.cli import main
from llmplan.llm.formats.gguf import open_gguf
from tests.llm.tiny_gguf import write_tiny_model
from tests.trust.checkpoints import private_cache_home

PLANS = Path(__file__).resolve().parents[2] / "plans"
FP32 = str(PLANS / "llama-fp32.yaml")
COMMON = ["--set", "generate.max_new_tokens=8", "--set", "lookup.mode=off", "--prompt", "the the"]
STORED = ["--set", "convert.dtype=stored"]


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Path]:
    yield from private_cache_home(tmp_path / "llmplan-cache")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "gguf" / "tiny-qwen2.gguf"
    path.parent.mkdir()
    write_tiny_model(str(path), arch="qwen2", tied=True, embed="Q8_0")
    return path


def _run(model: Path, out: Path, *extra: str, plan: str | None = FP32) -> tuple[int, dict]:
    args = ["run", *([plan] if plan else []), "--model", str(model), *COMMON, "--out", str(out), *extra]
    code = main(args)
    return code, json.loads((out / "generations.json").read_text())[0] if code == 0 else {}


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "kernels" not in p.relative_to(root).parts]


def _imports(cache: Path) -> list[Path]:
    return [p for p in (cache / "models").iterdir() if p.is_dir() and not p.name.startswith(".")]


def _block_offset(path: Path, tensor: str, block: int, type_size: int) -> int:
    with open_gguf(path) as parsed:
        return parsed.tensors[tensor].offset + block * type_size


def test_first_use_writes_no_shards_and_a_later_start_reads_none(
    tiny: Path, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, first = _run(tiny, tmp_path / "one", *STORED)
    said = capsys.readouterr().err
    assert code == 0, said
    assert not [p for p in cache.rglob("*.safetensors")]
    written = sum(p.stat().st_size for p in _files(cache))
    assert written < 200_000, sorted(str(p) for p in _files(cache))  # config, tokenizer, pin, records: a few KB
    [imported] = _imports(cache)
    assert sorted(p.name for p in imported.iterdir() if not p.name.startswith(".")) == [
        "SHA256SUMS",
        "config.json",
        "gguf_source.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    pin = json.loads((imported / "gguf_source.json").read_text())
    assert pin["size"] == tiny.stat().st_size and pin["blocks_checked"] is True and pin["path"] == str(tiny)
    assert "; weights read from tiny-qwen2.gguf as stored" in said and "imported config and tokenizer (" in said
    assert "tiny-qwen2.gguf: mapped, 0.8 MiB of Q4_K/Q6_K/Q8_0" in said

    def no_second_check(*_: object) -> int:
        raise AssertionError("check_block_values ran again on a later start")

    import llmplan.llm.formats.gguf as package
    import llmplan.llm.formats.gguf.importer as importer
    import llmplan.llm.formats.gguf.mapped as mapped

    for module in (package, importer, mapped):
        monkeypatch.setattr(module, "check_block_values", no_second_check)
    code, second = _run(tiny, tmp_path / "two", *STORED)
    said = capsys.readouterr().err
    assert code == 0, said
    assert "imported config and tokenizer" not in said and "as pinned (hash cache)" in said
    assert second["tokens"] == first["tokens"]
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["verify"]["shards"] == 0 and metrics["verify"]["gguf_bytes_hashed"] == 0
    assert "bytes_read" not in metrics["convert"] and metrics["read"]["tensors_wanted"] == 0


def test_no_plan_runs_a_gguf_as_stored(tiny: Path, cache: Path, tmp_path: Path, capsys) -> None:
    code, _ = _run(tiny, tmp_path / "one", plan=None)
    said = capsys.readouterr().err
    assert code == 0, said
    assert "weights read from tiny-qwen2.gguf as stored" in said and not list(cache.rglob("*.safetensors"))
    metrics = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert metrics["quantize"]["dtype"] == "stored"


def test_a_converting_plan_reads_the_file_itself_and_only_cache_false_adds_shards(
    tiny: Path, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stored_first = _run(tiny, tmp_path / "stored", *STORED)
    assert code == 0
    [imported] = _imports(cache)
    sums = (imported / "SHA256SUMS").read_text()
    capsys.readouterr()
    # A converting plan with the conversion cache (the default): the blocks dequantized once into its entry,
    # the import left as it was: no fp32 shards.
    code, fp32 = _run(tiny, tmp_path / "fp32")
    said = capsys.readouterr().err
    assert code == 0, said
    assert "cached conversion of tiny-qwen2.gguf" in said and "cached as" in said and fp32["tokens"]
    assert (imported / "SHA256SUMS").read_text() == sums and not list(imported.glob("*.safetensors"))
    # Converting every start (cache: false) reads fp32 shards, as before #55: added to the same import.
    code, memory = _run(tiny, tmp_path / "fp32-memory", "--set", "convert.cache=false")
    said = capsys.readouterr().err
    assert code == 0 and "with fp32 shards" in said and memory["tokens"] == fp32["tokens"]
    sums = (imported / "SHA256SUMS").read_text()
    assert "model.safetensors.index.json" in sums and ".safetensors" in sums
    assert not [p for p in (cache / "models").iterdir() if ".importing-" in p.name]
    code, stored_after = _run(tiny, tmp_path / "stored-again", *STORED)
    assert code == 0, capsys.readouterr().err
    assert stored_after["tokens"] == stored_first["tokens"]

    def fingerprint(run: str) -> str:
        return json.loads((tmp_path / run / "metrics.json").read_text())["model"]["fingerprint"]

    assert fingerprint("stored") == fingerprint("stored-again") == fingerprint("fp32") == fingerprint("fp32-memory")
    code, again = _run(tiny, tmp_path / "fp32-again")
    assert code == 0 and again["tokens"] == fp32["tokens"]
    assert "mapped from the conversion cache" in capsys.readouterr().err


def test_a_gguf_changed_after_first_use_is_refused_in_one_line(
    tiny: Path, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = _run(tiny, tmp_path / "one", *STORED)
    assert code == 0
    capsys.readouterr()
    at = _block_offset(tiny, "blk.1.ffn_up.weight", 2, 144) + 20  # a quant byte, not a scale
    data = bytearray(tiny.read_bytes())
    data[at] ^= 0xFF
    tiny.write_bytes(bytes(data))
    code, _ = _run(tiny, tmp_path / "two", *STORED)
    said = capsys.readouterr().err
    assert code == 1
    line = next(line for line in said.splitlines() if "changed since it was first used" in line)
    assert str(tiny) in line and "refused (delete" in line and "Traceback" not in said
    assert len(_imports(cache)) == 1  # nothing imported for the changed file


def test_a_changed_gguf_between_source_and_load_is_refused_by_its_pin(tiny: Path, cache: Path, tmp_path: Path) -> None:
    """The pin itself: the file the weights are mapped from is checked against the SHA-256 the import recorded."""
    from llmplan.llm.formats.gguf import PinError, check_pinned, import_gguf_as

    done = import_gguf_as(tiny, cache / "models", weights=False)
    assert check_pinned(done.model_dir, tiny).pin.sha256 == done.digest
    data = bytearray(tiny.read_bytes())
    data[-1] ^= 0xFF
    tiny.write_bytes(bytes(data))
    with pytest.raises(PinError, match=r"tiny-qwen2\.gguf: changed since it was first used \(SHA-256 "):
        check_pinned(done.model_dir, tiny)


def test_a_nan_block_scale_is_refused_at_first_use_naming_tensor_and_block(
    tiny: Path, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    at = _block_offset(tiny, "blk.0.attn_q.weight", 3, 144)  # Q4_K: d is the block's first fp16
    good = tiny.read_bytes()
    data = bytearray(good)
    data[at : at + 2] = b"\x00\x7e"  # fp16 NaN
    tiny.write_bytes(bytes(data))
    code, _ = _run(tiny, tmp_path / "one", *STORED)
    said = capsys.readouterr().err
    assert code == 1 and "Traceback" not in said
    [line] = [line for line in said.splitlines() if "NaN" in line]
    assert "tensor blk.0.attn_q.weight: block 3 has a NaN or infinite fp16 scale" in line, line
    assert not _imports(cache)  # nothing kept, and the refused file is not pinned: the mended one runs
    tiny.write_bytes(good)
    code, _ = _run(tiny, tmp_path / "two", *STORED)
    assert code == 0, capsys.readouterr().err
