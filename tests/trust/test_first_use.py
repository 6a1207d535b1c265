"""`--model PATH` and trust on first use: a folder without SHA256SUMS is hashed once, its later changes refused.

The folder is a tiny model saved by transformers' `save_pretrained` (no SHA256SUMS, as people's folders are);
the record lives in a private LLMPLAN_CACHE, and the folder itself is never written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmplan.engine.cli import main
from llmplan.llm.trust.first_use import RECORDS_DIR
from tests.stages.tiny_run import make_tiny_model_dir
from tests.trust.checkpoints import private_cache_home

TRUSTED = "trusted on first use"


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private LLMPLAN_CACHE (the hash key and the records live there), with the compiled kernels copied in."""
    yield from private_cache_home(tmp_path_factory.mktemp("llmplan-cache"))


@pytest.fixture(scope="module")
def saved(cache_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `save_pretrained` folder with a tokenizer; its context long enough for the default plan's 2048 cache."""
    model_dir, _ = make_tiny_model_dir(tmp_path_factory.mktemp("saved"))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    assert not (model_dir / "SHA256SUMS").exists()
    return model_dir


def copy_of(saved: Path, tmp_path: Path) -> Path:
    """A fresh folder per test: another path, so another first use."""
    return Path(shutil.copytree(saved, tmp_path / "my-model"))


def listing(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry with its size, mtime and content hash: what "nothing written there" is checked against."""
    out = {}
    for path in sorted(folder.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns, digest)
    return out


def records(cache_home: Path) -> list[Path]:
    return sorted((cache_home / RECORDS_DIR).glob("*/SHA256SUMS"))


def deep(model: Path, capsys: pytest.CaptureFixture[str], *plans: str) -> tuple[int, str]:
    code = main(["validate", "--deep", "--model", str(model), *plans])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_run_model_with_no_other_flag_uses_the_default_plan_and_trusts_the_folder_on_first_use(
    saved: Path, cache_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = copy_of(saved, tmp_path)
    before = listing(model)
    assert main(["run", "--model", str(model)]) == 0
    first = capsys.readouterr().err
    assert first.count(TRUSTED) == 1, first
    assert listing(model) == before  # nothing written into the user's folder
    [record] = [r for r in records(cache_home) if (r.parent / "folder").read_text().strip() == str(model.resolve())]
    listed = {line.split("  ", 1)[1] for line in record.read_text().splitlines()}
    assert listed == {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"}
    assert str(record) in first
    result = json.loads((tmp_path / "out" / "llama-int8.json").read_text())  # the data home: tests/conftest.py
    assert result["plan"] == "llama-int8" and result["results"][0]["text"]

    assert main(["run", "--model", str(model), "--quiet"]) == 0
    assert TRUSTED not in capsys.readouterr().err  # said once: the second use checks against the record


def test_a_changed_file_is_refused_with_one_line_naming_it(
    saved: Path, cache_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = copy_of(saved, tmp_path)
    assert deep(model, capsys)[0] == 0
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    code, said = deep(model, capsys)
    assert code == 1
    [line] = [line for line in said.splitlines() if "config.json" in line]
    assert f"{model / 'config.json'}: changed since the folder was first used" in line
    assert "Traceback" not in said and TRUSTED not in said

    shard = model / "model.safetensors"  # one flipped byte in the weights, size unchanged
    (model / "config.json").write_text(json.dumps(config))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    code, said = deep(model, capsys)
    assert code == 1 and f"{shard}: changed since the folder was first used" in said, said


def test_a_file_added_or_removed_after_first_use_is_refused(
    saved: Path, cache_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = copy_of(saved, tmp_path)
    kept = (model / "tokenizer_config.json").read_bytes()
    (model / "tokenizer_config.json").unlink()
    assert deep(model, capsys)[0] == 0
    (model / "tokenizer_config.json").write_bytes(kept)  # a chat template nobody hashed
    code, said = deep(model, capsys)
    assert code == 1
    assert f"{model / 'tokenizer_config.json'}: not there when the folder was first used" in said, said

    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer.json").unlink()
    code, said = deep(model, capsys)
    assert code == 1 and f"{model / 'tokenizer.json'}: listed in the first-use record" in said, said


def test_deleting_the_record_trusts_the_folder_as_it_is_now(
    saved: Path, cache_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = copy_of(saved, tmp_path)
    assert deep(model, capsys)[0] == 0
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text() + " ")
    code, said = deep(model, capsys)
    assert code == 1
    folder = said.split("(delete ", 1)[1].split(" to trust", 1)[0]
    shutil.rmtree(folder)
    code, said = deep(model, capsys)
    assert code == 0 and said.count(TRUSTED) == 1, said


def _hub_snapshot(saved: Path, root: Path) -> Path:
    """The Hub cache layout: models--org--name/snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    repo = root / "models--someone--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    for path in saved.iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, repo / "blobs" / digest)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", digest))
    return snapshot


def test_a_hub_cache_snapshot_is_a_model_folder_and_its_links_must_stay_in_its_repository(
    saved: Path, cache_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = _hub_snapshot(saved, tmp_path / "hub")
    code, said = deep(snapshot, capsys)
    assert code == 0 and said.count(TRUSTED) == 1, said

    elsewhere = tmp_path / "elsewhere"  # a link out of models--someone--tiny: refused, never read
    elsewhere.mkdir()
    shutil.copyfile(saved / "tokenizer_config.json", elsewhere / "tokenizer_config.json")
    other = _hub_snapshot(saved, tmp_path / "hub2")
    (other / "tokenizer_config.json").unlink()
    (other / "tokenizer_config.json").symlink_to(elsewhere / "tokenizer_config.json")
    code, said = deep(other, capsys)
    assert code == 1 and "symlink escapes the model directory" in said and "tokenizer_config.json" in said, said
    assert TRUSTED not in said


def test_model_replaces_the_plans_source_without_editing_the_plan(
    saved: Path, cache_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.trust.checkpoints import plan_for

    model = copy_of(saved, tmp_path)
    plan = plan_for(tmp_path, tmp_path / "no-such-model", hashes="required")
    text = plan.read_text()
    code, said = deep(model, capsys, str(plan))
    assert code == 0, said  # `hashes: required` is met by the first-use record
    assert plan.read_text() == text
    assert main(["validate", "--deep", str(plan)]) == 1  # without --model: the plan's own (missing) folder
    assert "no-such-model: model path not found" in capsys.readouterr().out


def test_tokenize_takes_model_too(saved: Path, cache_home: Path, tmp_path: Path, capsys) -> None:
    model = copy_of(saved, tmp_path)
    assert main(["tokenize", "--model", str(model), "Hello model", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "Hello model" and out["ids"]


@pytest.mark.parametrize("command", ["run", "chat", "bench", "tokenize", "validate"])
def test_a_model_where_the_plan_belongs_says_to_use_model(
    saved: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["hello"] if command == "tokenize" else []
    assert main([command, str(saved), *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"{saved}: a model, not a plan file; run it with `llmplan {command} --model {saved}` (the default plan) "
        f"or `llmplan {command} PLAN --model {saved}`"
    ]


def test_no_plan_and_a_missing_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # `run` with no plan at all runs the default plan now (#57: tests/stages/test_first_hour.py)
    assert main(["validate"]) == 1
    assert capsys.readouterr().err.strip() == "validate: give plan files, or --model PATH"
    assert main(["run", "--model", "/no/such/model"]) == 1
    assert "--model /no/such/model: not found" in capsys.readouterr().err
