"""Hostile corpus: what the load may read, the hash cache, and the model cache directory.

Every file the load reads is in SHA256SUMS or refused; the hash cache vouches only for an entry it can
prove it wrote for exactly these bytes (and a damaged, forged or non-file cache is never trusted, never
read without bound); a read-only cache still serves runs; an import killed midway is cleaned up by the
next one, and nothing that is not provably such a leftover is ever removed.

Each hostile case runs the real command line (in-process, or in a child where a mount or a process is
part of the case) and asserts a clean refusal naming the file, a time bound, a memory bound, and a
byte-for-byte snapshot of the checkpoint and the user's files. The benign twins at the end must run.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from llmplan.engine.cli import main
from llmplan.llm.formats.gguf import import_gguf
from llmplan.llm.formats.import_dirs import OWNER_NAME, make_import_dir, remove_stale_imports
from llmplan.llm.trust import MANIFEST_NAME, read_sha256sums
from llmplan.llm.trust.hash_cache import CACHE_NAME, FORMAT, KEY_NAME, identity
from llmplan.llm.trust.manifest import sha256_file, write_sha256sums
from tests.stages.tiny_run import load_stages

from .checkpoints import LISTED, make_checkpoint, plan_for, private_cache_home
from .hostile import Snapshot, assert_clean_message, assert_untouched, memory_bound, refused, snapshot, time_bound

INDEX = "model.safetensors.index.json"
REPO = Path(__file__).resolve().parents[2]


# --- fixtures: one tiny checkpoint, one tiny GGUF, and a private LLMPLAN_CACHE for the whole module -------------


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private LLMPLAN_CACHE (the hash key lives there), with the compiled kernels copied in (no rebuild)."""
    yield from private_cache_home(tmp_path_factory.mktemp("llmplan-cache"))


@pytest.fixture(scope="module")
def pristine(cache_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = make_checkpoint(root)
    # One run first, so later memory bounds measure the case and not torch's first-use allocations.
    code = main(["run", str(plan_for(root, model_dir)), "--out", str(root / "warm-up"), "--quiet"])
    assert code == 0
    (model_dir / CACHE_NAME).unlink(missing_ok=True)
    return model_dir


@pytest.fixture(scope="module")
def tiny_gguf(cache_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    from tests.llm.test_gguf_import import _write_tiny

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_tiny(path)
    return path


@pytest.fixture
def model_dir(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "model", symlinks=True))


def first_shard(model_dir: Path) -> Path:
    return sorted(model_dir.glob("model-*.safetensors"))[0]


def relist(model_dir: Path, *, drop: tuple[str, ...] = (), only_shards: bool = False) -> None:
    """Rewrite SHA256SUMS so that it lists every file the load reads except `drop` (consistent hashes)."""
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    names = shards if only_shards else [*shards, *(n for n in LISTED if os.path.isfile(model_dir / n))]
    write_sha256sums(model_dir, [n for n in names if n not in drop])


def flip_last_byte(path: Path) -> None:
    """One weight changed in place: same size, same header; only the SHA-256 can tell."""
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0x5A]))


def run_refused(
    model_dir: Path,
    tmp: Path,
    capsys: pytest.CaptureFixture[str],
    names: tuple[str, ...],
    *,
    hashes: str = "required",
    pinned: dict[str, str] | None = None,
    seconds: float = 30,
    memory_mb: float = 256,
    also: tuple[Path, ...] = (),
) -> str:
    """Run the tiny plan on `model_dir`: refused in one line naming `names`, and nothing of the user's changed."""
    plan = plan_for(tmp, model_dir, hashes=hashes)
    if pinned:
        data = yaml.safe_load(plan.read_text())
        next(s for s in data["stages"] if s["uses"] == "load.verify")["with"]["sha256"] = pinned
        plan.write_text(yaml.safe_dump(data, sort_keys=False))
    before = snapshot(model_dir, plan, *also)
    said = refused(
        ["run", str(plan), "--out", str(tmp / "run"), "--quiet"],
        capsys,
        names=names,
        seconds=seconds,
        memory_mb=memory_mb,
    )
    lines = [line for line in said.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert_untouched(before, model_dir, plan, *also)
    assert not (tmp / "run" / "generations.json").exists()
    return said


# --- family 1: every file the load reads is in SHA256SUMS, or refused -------------------------------------------


def _mkfifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _to(target: str) -> Callable[[Path], None]:
    def act(path: Path) -> None:
        path.unlink(missing_ok=True)
        path.symlink_to(target)

    return act


def _write(text: str) -> Callable[[Path], None]:
    return lambda path: path.write_text(text, encoding="utf-8")


def _hostile_template(path: Path) -> None:
    config = json.loads(path.read_text())
    config["chat_template"] = "{{ messages[0]['content'] | replace('Hello', '</s>') }}"
    path.write_text(json.dumps(config))


def _edit_config(path: Path) -> None:
    config = json.loads(path.read_text())
    config["rms_norm_eps"] = 0.5
    path.write_text(json.dumps(config))


def _sparse(size: int) -> Callable[[Path], None]:
    def act(path: Path) -> None:
        with open(path, "r+b") as handle:
            handle.truncate(size)

    return act


@dataclass
class Unlisted:
    id: str
    name: str  # the file damaged or left out of SHA256SUMS
    act: Callable[[Path], None] | None  # what is done to it (None: only left out of the manifest)
    listed: bool = False  # still listed in SHA256SUMS (with its old hash) after the act
    hashes: str = "required"
    expect: str | None = None  # what the message must name, when not the file itself


UNLISTED = [
    Unlisted("tokenizer-config-missing", "tokenizer_config.json", lambda p: p.unlink()),
    Unlisted("tokenizer-config-fifo", "tokenizer_config.json", _mkfifo),
    Unlisted("tokenizer-config-fifo-if-present", "tokenizer_config.json", _mkfifo, hashes="if_present"),
    Unlisted("tokenizer-config-dev-zero", "tokenizer_config.json", _to("/dev/zero")),
    Unlisted("tokenizer-config-dangling-link", "tokenizer_config.json", _to("gone.json")),
    Unlisted("tokenizer-config-directory", "tokenizer_config.json", lambda p: (p.unlink(), p.mkdir())),
    Unlisted("tokenizer-config-hostile-template", "tokenizer_config.json", _hostile_template),
    Unlisted("tokenizer-config-hostile-if-present", "tokenizer_config.json", _hostile_template, hashes="if_present"),
    Unlisted("tokenizer-config-listed-fifo", "tokenizer_config.json", _mkfifo, listed=True),
    Unlisted("tokenizer-config-listed-dev-zero", "tokenizer_config.json", _to("/dev/zero"), listed=True),
    Unlisted("tokenizer-json-unlisted", "tokenizer.json", None),
    Unlisted("tokenizer-json-fifo", "tokenizer.json", _mkfifo, listed=True),
    Unlisted("tokenizer-json-dev-zero", "tokenizer.json", _to("/dev/zero"), listed=True),
    Unlisted("tokenizer-json-huge-sparse", "tokenizer.json", _sparse(65 << 20), listed=True),
    Unlisted("config-unlisted-and-edited", "config.json", _edit_config, hashes="if_present"),
    Unlisted("index-unlisted", INDEX, None, hashes="if_present"),
    Unlisted("shard-unlisted", "model-00003-of-00014.safetensors", None, hashes="if_present"),
    Unlisted("converted-marker-planted", "llmplan_converted.json", _write('{"format": "llmplan.converted/v1"}')),
    Unlisted("converted-marker-fifo", "llmplan_converted.json", _mkfifo),
    Unlisted("converted-marker-dev-zero", "llmplan_converted.json", _to("/dev/zero")),
]


@pytest.mark.parametrize("case", UNLISTED, ids=[c.id for c in UNLISTED])
def test_a_file_the_load_reads_is_listed_or_refused(
    case: Unlisted, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = model_dir / case.name
    if not case.listed:
        relist(model_dir, drop=(case.name,))
    if case.act is not None:
        case.act(target)
    run_refused(model_dir, tmp_path, capsys, (case.expect or target.name,), hashes=case.hashes, seconds=20)


def test_a_shards_only_manifest_is_refused_naming_what_it_leaves_out(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    relist(model_dir, only_shards=True)  # `sha256sum *.safetensors > SHA256SUMS`: config and tokenizer unchecked
    said = run_refused(model_dir, tmp_path, capsys, (INDEX, MANIFEST_NAME), hashes="if_present")
    assert "not listed" in said


# --- family 2: the hash cache vouches only for what it provably hashed ------------------------------------------


def expected_hash(model_dir: Path, name: str) -> str:
    return read_sha256sums(model_dir / MANIFEST_NAME)[name]


def mac_with(key: bytes, ident: list[int], digest: str) -> str:
    message = json.dumps([FORMAT, ident, digest], separators=(",", ":")).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def write_cache(model_dir: Path, entries: dict[str, object], fmt: str = FORMAT) -> None:
    (model_dir / CACHE_NAME).write_text(json.dumps({"format": fmt, "entries": entries}), encoding="utf-8")


def warm_cache(model_dir: Path, tmp: Path) -> None:
    """A genuine cache, recorded by llmplan itself on a clean run."""
    assert main(["run", str(plan_for(tmp, model_dir, name="warm")), "--out", str(tmp / "warm"), "--quiet"]) == 0
    assert (model_dir / CACHE_NAME).is_file()


def forge(mac: Callable[[list[int], str], object]) -> Callable[[Path, Path, Path], None]:
    """Damage the first shard, then write a cache entry claiming its new identity has the expected hash."""

    def act(model_dir: Path, tmp: Path, shard: Path) -> None:
        flip_last_byte(shard)
        ident = identity(shard)
        digest = expected_hash(model_dir, shard.name)
        write_cache(model_dir, {shard.name: {"identity": ident, "sha256": digest, "mac": mac(ident, digest)}})

    return act


def _stolen_mac(model_dir: Path, tmp: Path, shard: Path) -> None:
    """A genuine entry for the clean bytes; the shard is then edited in place with its mtime put back."""
    warm_cache(model_dir, tmp)
    before = shard.stat()
    flip_last_byte(shard)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))


def _swapped_shards(model_dir: Path, tmp: Path, shard: Path) -> None:
    """Two shards' files swapped, and their genuine cache entries swapped with them."""
    warm_cache(model_dir, tmp)
    other = sorted(model_dir.glob("model-*.safetensors"))[1]
    spare = model_dir / "spare"
    os.rename(shard, spare)
    os.rename(other, shard)
    os.rename(spare, other)
    cache = json.loads((model_dir / CACHE_NAME).read_text())
    entries = cache["entries"]
    entries[shard.name], entries[other.name] = entries[other.name], entries[shard.name]
    (model_dir / CACHE_NAME).write_text(json.dumps(cache))


def _cache_file(act: Callable[[Path], None]) -> Callable[[Path, Path, Path], None]:
    def damage(model_dir: Path, tmp: Path, shard: Path) -> None:
        warm_cache(model_dir, tmp)
        flip_last_byte(shard)
        act(model_dir / CACHE_NAME)

    return damage


def _garbage(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def _entry_edit(edit: Callable[[dict], None]) -> Callable[[Path], None]:  # type: ignore[type-arg]
    """A genuine cache whose entries are then edited to claim the damaged shard."""

    def act(path: Path) -> None:
        model_dir = path.parent
        shard = first_shard(model_dir)
        cache = json.loads(path.read_text())
        entry = cache["entries"][shard.name]
        entry["identity"] = identity(shard)
        edit(entry)
        path.write_text(json.dumps(cache))

    return act


@dataclass
class Forged:
    id: str
    act: Callable[[Path, Path, Path], None]
    pinned: bool = False
    seconds: float = 30
    memory_mb: float = 256
    expect: str = "SHA-256 mismatch"


FORGED = [
    Forged("entry-without-mac", forge(lambda ident, digest: None)),
    Forged("entry-random-mac", forge(lambda ident, digest: secrets.token_hex(32))),
    Forged("entry-attackers-own-key", forge(lambda ident, digest: mac_with(secrets.token_bytes(32), ident, digest))),
    Forged("entry-mac-of-empty-key", forge(lambda ident, digest: mac_with(b"", ident, digest))),
    Forged("entry-forged-with-plan-pinned-hash", forge(lambda ident, digest: secrets.token_hex(32)), pinned=True),
    Forged("entry-old-format-v1", lambda m, t, s: (flip_last_byte(s), _v1_cache(m, s))),
    Forged("entry-old-format-v1-pinned", lambda m, t, s: (flip_last_byte(s), _v1_cache(m, s)), pinned=True),
    Forged("genuine-entry-new-identity-same-mac", _cache_file(_entry_edit(lambda e: None))),
    Forged("genuine-entry-mtime-restored", _stolen_mac),
    Forged("genuine-entry-mtime-restored-pinned", _stolen_mac, pinned=True),
    Forged("genuine-entries-swapped-with-shards", _swapped_shards, expect="does not contain"),
    Forged("cache-file-garbage", _cache_file(_garbage(b"\x00\xff garbage {{{"))),
    Forged("cache-file-empty", _cache_file(_garbage(b""))),
    Forged("cache-file-json-list", _cache_file(_garbage(b"[1, 2, 3]"))),
    Forged("cache-file-deep-nesting", _cache_file(_garbage(b"[" * 200_000 + b"]" * 200_000))),
    Forged("cache-file-5000-digit-number", _cache_file(_garbage(b'{"format": 1' + b"0" * 5000 + b"}"))),
    Forged("cache-file-huge-sparse", _cache_file(lambda p: os.truncate(p, 16 << 20)), memory_mb=128),
    Forged("cache-file-fifo", _cache_file(_mkfifo), seconds=15),
    Forged("cache-file-dev-zero", _cache_file(_to("/dev/zero")), memory_mb=128),
    Forged("cache-file-dev-urandom", _cache_file(_to("/dev/urandom")), memory_mb=128),
    Forged("cache-file-directory", _cache_file(lambda p: (p.unlink(), p.mkdir()))),
    Forged("entry-sha256-not-hex", _cache_file(_entry_edit(lambda e: e.update(sha256="../" * 21 + "x")))),
    Forged(
        "entry-identity-strings", _cache_file(_entry_edit(lambda e: e.update(identity=[str(x) for x in e["identity"]])))
    ),
    Forged(
        "entry-identity-floats",
        _cache_file(_entry_edit(lambda e: e.update(identity=[float(x) for x in e["identity"]]))),
    ),
    Forged("entry-not-an-object", _cache_file(_entry_edit(lambda e: e.clear()))),
]


def _v1_cache(model_dir: Path, shard: Path) -> None:
    """The old cache format (no MAC), claiming the damaged shard: what the forged entries of issue 33 used."""
    entry = {"identity": identity(shard), "sha256": expected_hash(model_dir, shard.name)}
    (model_dir / CACHE_NAME).write_text(json.dumps({shard.name: entry}))


@pytest.mark.parametrize("case", FORGED, ids=[c.id for c in FORGED])
def test_the_hash_cache_never_vouches_for_damaged_weights(
    case: Forged, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = first_shard(model_dir)
    pinned = {shard.name: expected_hash(model_dir, shard.name)} if case.pinned else None
    case.act(model_dir, tmp_path, shard)
    said = run_refused(
        model_dir, tmp_path, capsys, (shard.name,), pinned=pinned, seconds=case.seconds, memory_mb=case.memory_mb
    )
    assert case.expect in said


@dataclass
class BadKey:
    id: str
    act: Callable[[Path], None]
    seconds: float = 15


def _key_readable(path: Path) -> None:
    path.chmod(0o644)


def _key_link(path: Path) -> None:
    """The key replaced by a link to a file the attacker wrote (and so knows)."""
    known = path.with_name("attacker.key")
    known.write_bytes(b"k" * 32)
    known.chmod(0o600)
    path.unlink()
    path.symlink_to(known.name)


BAD_KEYS = [
    BadKey("key-world-readable", _key_readable),
    BadKey("key-symlink-to-known-bytes", _key_link),
    BadKey("key-truncated", lambda p: p.write_bytes(p.read_bytes()[:5])),
    BadKey("key-fifo", _mkfifo),
    BadKey("key-dev-zero", _to("/dev/zero")),
]


@pytest.mark.parametrize("case", BAD_KEYS, ids=[c.id for c in BAD_KEYS])
def test_a_key_others_could_know_disables_the_cache(
    case: BadKey, cache_home: Path, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the key readable by others (or replaced), entries made with it prove nothing: all hashed again."""
    key = cache_home / KEY_NAME
    saved = key.read_bytes()
    shard = first_shard(model_dir)
    try:
        case.act(key)
        if key.is_file() and not key.is_symlink() and len(key.read_bytes()) == 32:
            forged_key = key.read_bytes()  # an attacker who can read it forges with it
        else:
            forged_key = b"k" * 32
        forge(lambda ident, digest: mac_with(forged_key, ident, digest))(model_dir, tmp_path, shard)
        key_before = snapshot(cache_home / KEY_NAME)
        said = run_refused(model_dir, tmp_path, capsys, (shard.name,), seconds=case.seconds, memory_mb=128)
        assert "SHA-256 mismatch" in said
        assert_untouched(key_before, cache_home / KEY_NAME)  # never "repaired" behind the user's back
    finally:
        key.unlink(missing_ok=True)
        (cache_home / "attacker.key").unlink(missing_ok=True)
        key.write_bytes(saved)
        key.chmod(0o600)


# --- family 3: the GGUF import's cache directory -----------------------------------------------------------------


def gguf_plan(tmp: Path, gguf: Path, cache_dir: Path | None = None, name: str = "gguf") -> Path:
    stages = load_stages(gguf, hashes="required")
    if cache_dir is not None:
        stages[1]["with"]["cache_dir"] = str(cache_dir)
    plan = {
        "name": name,
        "device": "cpu",
        "seed": 0,
        "threads": 1,
        "observe": {"memory_interval_ms": 0},
        "stages": [
            *stages,
            {"id": "prompt", "uses": "compute.tokenize", "with": {"messages": [{"role": "user", "content": "the"}]}},
            {
                "id": "generate",
                "uses": "compute.generate",
                "with": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": False},
            },
        ],
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False), encoding="utf-8")
    return path


def test_a_gguf_fifo_is_refused_without_waiting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    plan = gguf_plan(tmp_path, fifo, tmp_path / "cache")
    before = snapshot(tmp_path / "model.gguf", plan)
    refused(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"], capsys, names=("model.gguf",), seconds=15)
    assert_untouched(before, tmp_path / "model.gguf", plan)
    assert not (tmp_path / "cache").exists()


def test_a_gguf_linked_to_dev_zero_is_refused_within_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "zero.gguf"
    link.symlink_to("/dev/zero")
    plan = gguf_plan(tmp_path, link, tmp_path / "cache")
    refused(
        ["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"],
        capsys,
        names=("zero.gguf",),
        seconds=15,
        memory_mb=128,
    )
    assert not (tmp_path / "cache").exists()


def test_a_forged_gguf_cache_entry_cannot_redirect_the_import(tiny_gguf: Path, tmp_path: Path) -> None:
    """The cache root's entry for the GGUF names another digest, whose directory is self-consistent garbage."""
    cache = tmp_path / "cache"
    decoy = cache / f"{'0' * 16}-{tiny_gguf.stem}"
    decoy.mkdir(parents=True)
    (decoy / "config.json").write_text("{}")
    write_sha256sums(decoy, ["config.json"])
    fake = "0" * 64
    ident = identity(tiny_gguf)
    entry = {"identity": ident, "sha256": fake, "mac": mac_with(secrets.token_bytes(32), ident, fake)}
    (cache / CACHE_NAME).write_text(json.dumps({"format": FORMAT, "entries": {str(tiny_gguf.absolute()): entry}}))
    before = snapshot(decoy, tiny_gguf)
    out = import_gguf(tiny_gguf, cache)
    assert out.name.startswith(sha256_file(tiny_gguf)[:16]) and out != decoy
    assert_untouched(before, decoy, tiny_gguf)


def test_a_cache_root_that_is_a_file_is_refused(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "important.db"
    blocker.write_bytes(b"the user's data")
    plan = gguf_plan(tmp_path, tiny_gguf, blocker)
    before = snapshot(blocker, tiny_gguf)
    refused(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"], capsys, names=("important.db",))
    assert_untouched(before, blocker, tiny_gguf)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _owner(temp: Path, **change: object) -> None:
    record = json.loads((temp / OWNER_NAME).read_text())
    record.update(change)
    (temp / OWNER_NAME).write_text(json.dumps(record))


def _leftover(cache: Path, pid: int, nonce: str = "0badc0de", **change: object) -> Path:
    """An import directory as `make_import_dir` writes it, re-labelled to belong to `pid`."""
    made = make_import_dir(cache / "0123456789abcdef-tiny-llama")
    temp = cache / f".0123456789abcdef-tiny-llama.importing-{pid}-{nonce}"
    os.rename(made, temp)
    _owner(temp, pid=pid, nonce=nonce, start_time=_start_of(pid), **change)
    (temp / "config.json").write_text("{}")
    (temp / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 4096)
    return temp


def test_an_import_killed_midway_is_cleaned_up_by_the_next(tiny_gguf: Path, tmp_path: Path) -> None:
    """A real import process, SIGKILLed while writing: its directory is gone after the next import."""
    cache = tmp_path / "cache"
    cache.mkdir()
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from llmplan.llm.formats.gguf import importer as gguf_import
        def die(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        gguf_import._write_shards = die
        gguf_import.import_gguf(Path({str(tiny_gguf)!r}), Path({str(cache)!r}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=60, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-600:]
    left = [p for p in cache.iterdir() if ".importing-" in p.name]
    assert len(left) == 1 and (left[0] / "config.json").is_file(), "the killed import left its directory"
    user = cache / "notes.txt"
    user.write_text("mine")
    before = snapshot(user, tiny_gguf)
    with time_bound(60):
        out = import_gguf(tiny_gguf, cache)
    assert not left[0].exists()
    assert (out / MANIFEST_NAME).is_file()
    assert_untouched(before, user, tiny_gguf)
    # One left while another process finished the same import: the next (warm) run removes it too.
    again = _leftover(cache, _dead_pid())
    assert import_gguf(tiny_gguf, cache) == out and not again.exists()
    assert_untouched(before, user, tiny_gguf)


def _fifo_owner(temp: Path) -> None:
    _mkfifo(temp / OWNER_NAME)


def _zero_owner(temp: Path) -> None:
    (temp / OWNER_NAME).unlink()
    (temp / OWNER_NAME).symlink_to("/dev/zero")


@dataclass
class NotOurs:
    id: str
    make: Callable[[Path, int], Path]  # (cache, a dead pid) -> the entry that must survive


def _named_dir_no_owner(cache: Path, pid: int) -> Path:
    path = cache / f".thesis.importing-{pid}-abcdef01"
    path.mkdir()
    (path / "thesis.tex").write_text("\\documentclass{article}")
    return path


def _with_user_file(cache: Path, pid: int) -> Path:
    temp = _leftover(cache, pid)
    (temp / "thesis.tex").write_text("years of work")
    return temp


def _with_subdir(cache: Path, pid: int) -> Path:
    temp = _leftover(cache, pid)
    (temp / "photos").mkdir()
    (temp / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    return temp


def _with_symlink_inside(cache: Path, pid: int) -> Path:
    temp = _leftover(cache, pid)
    (temp / "config.json").unlink()
    (temp / "config.json").symlink_to(cache.parent / "user-config.json")
    return temp


def _link_to_user_dir(cache: Path, pid: int) -> Path:
    user = cache.parent / "user-dir"
    user.mkdir()
    (user / "config.json").write_text("mine")
    (user / OWNER_NAME).write_text(json.dumps({"format": "llmplan.import-owner/v1", "pid": pid, "nonce": "abcdef02"}))
    link = cache / f".x.importing-{pid}-abcdef02"
    link.symlink_to(user)
    return link


def _plain_file(cache: Path, pid: int) -> Path:
    path = cache / f".x.importing-{pid}-abcdef03"
    path.write_text("a file, not a directory")
    return path


NOT_OURS = [
    NotOurs("named-like-an-import-but-no-owner-record", _named_dir_no_owner),
    NotOurs("owner-record-but-a-user-file-inside", _with_user_file),
    NotOurs("owner-record-but-a-subdirectory-inside", _with_subdir),
    NotOurs("owner-record-but-a-symlink-inside", _with_symlink_inside),
    NotOurs("symlink-to-a-user-directory", _link_to_user_dir),
    NotOurs("a-plain-file-named-like-an-import", _plain_file),
    NotOurs("owner-pid-differs-from-the-name", lambda c, pid: _retag(_leftover(c, pid), pid=pid + 1)),
    NotOurs("owner-nonce-differs-from-the-name", lambda c, pid: _retag(_leftover(c, pid), nonce="ffffffff")),
    NotOurs("owner-from-another-host", lambda c, pid: _retag(_leftover(c, pid), host="elsewhere.example")),
    NotOurs("owner-record-wrong-format", lambda c, pid: _retag(_leftover(c, pid), format="something/else")),
    NotOurs("owner-record-fifo", lambda c, pid: _then(_leftover(c, pid), _fifo_owner)),
    NotOurs("owner-record-dev-zero", lambda c, pid: _then(_leftover(c, pid), _zero_owner)),
    NotOurs("owner-process-alive", lambda c, pid: _leftover(c, os.getppid())),
    NotOurs("owner-is-this-process", lambda c, pid: _leftover(c, os.getpid())),
]


def _retag(temp: Path, **change: object) -> Path:
    _owner(temp, **change)
    return temp


def _then(temp: Path, act: Callable[[Path], None]) -> Path:
    act(temp)
    return temp


@pytest.mark.parametrize("case", NOT_OURS, ids=[c.id for c in NOT_OURS])
def test_nothing_that_is_not_provably_a_dead_import_is_removed(case: NotOurs, tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (tmp_path / "user-config.json").write_text("the user's")
    survivor = case.make(cache, _dead_pid())
    before: Snapshot = snapshot(tmp_path, tiny_gguf)
    with time_bound(30), memory_bound(128):
        assert remove_stale_imports(cache) == []
        out = import_gguf(tiny_gguf, cache)
    assert os.path.lexists(survivor)
    ours = (str(out), str(cache / CACHE_NAME))  # what the import itself wrote
    after = {p: v for p, v in snapshot(tmp_path, tiny_gguf).items() if not p.startswith(ours)}
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:5]


def test_a_reused_pid_does_not_keep_a_dead_import(tmp_path: Path) -> None:
    """The pid in the record is running, but it started at another time: another process, the owner is dead."""
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = _retag(_leftover(cache, os.getppid()), start_time=1)
    kept = _leftover(cache, os.getppid(), nonce="0badc0df")
    assert remove_stale_imports(cache) == [stale]
    assert not stale.exists() and kept.is_dir()


# --- benign twins: what must keep working --------------------------------------------------------------------


def test_a_live_import_is_left_alone(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _leftover(cache, sleeper.pid)
        _owner(live, start_time=_start_of(sleeper.pid))
        before = snapshot(live)
        assert remove_stale_imports(cache) == []
        assert_untouched(before, live)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale_imports(cache) == [live]  # and once its process is gone, it is cleaned up


def _start_of(pid: int) -> int | None:
    from llmplan.llm.formats.import_dirs import _start_time

    return _start_time(pid)


def test_a_warm_genuine_cache_is_used(model_dir: Path, tmp_path: Path) -> None:
    warm_cache(model_dir, tmp_path)
    assert main(["run", str(plan_for(tmp_path, model_dir)), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    verify = json.loads((tmp_path / "run" / "metrics.json").read_text())["verify"]
    assert verify["bytes_hashed"] == 0 and len(verify["hash_cached"]) == len(LISTED) + 14


def test_hashes_off_still_reads_unlisted_files(model_dir: Path, tmp_path: Path) -> None:
    """`hashes: off` means existence only: a manifest that leaves files out is not enforced then."""
    relist(model_dir, only_shards=True)
    assert main(["run", str(plan_for(tmp_path, model_dir, hashes="off")), "--out", str(tmp_path / "r"), "--quiet"]) == 0


@dataclass
class Child:
    code: int
    out: str
    err: str
    peak_mb: float


def read_only_child(argv: list[str], read_only: Path, seconds: float = 120) -> Child:
    """`llmplan ARGV` in a child that sees `read_only` as a read-only file system (a private bind mount).

    As root, permission bits do not stop writes: a read-only mount in a private mount namespace does,
    and it vanishes with the child. Without root, the tree's write bits are removed for the run instead.
    """
    cli = [sys.executable, "-m", "llmplan", *argv]
    if os.geteuid() == 0:
        if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
            pytest.skip("no private mount namespace here (unshare -m)")
        mount = f'mount --bind -o ro "{read_only}" "{read_only}" && exec "$@"'
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh", *cli]
    else:
        subprocess.run(["chmod", "-R", "a-w", str(read_only)], check=True)
        command = cli
    # RUSAGE_CHILDREN of this process is the largest of *every* child the session ever waited for (a 2 GB
    # load of another test would count): a fresh wrapper process measures this command's tree alone.
    peak_file = read_only.parent / f".peak-{os.getpid()}-{time.monotonic_ns()}"
    command = [sys.executable, "-c", _PEAK_OF_COMMAND, str(peak_file), *command]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds, cwd=REPO)
    finally:
        if os.geteuid() != 0:
            subprocess.run(["chmod", "-R", "u+w", str(read_only)], check=True)
    peak = int(peak_file.read_text()) / 1024
    peak_file.unlink()
    return Child(done.returncode, done.stdout, done.stderr, peak)


_PEAK_OF_COMMAND = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[2:]).returncode
with open(sys.argv[1], "w") as out:
    out.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def warm_home(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A whole LLMPLAN_CACHE (kernels, key, the GGUF import, both hash caches), warmed by one run."""
    home = tmp_path_factory.mktemp("warm-home")
    real = Path(os.environ["LLMPLAN_CACHE"]) / "kernels"
    if real.is_dir():
        shutil.copytree(real, home / "kernels")
    plan = gguf_plan(home.parent, tiny_gguf, name="warm-home")
    old = os.environ["LLMPLAN_CACHE"]
    os.environ["LLMPLAN_CACHE"] = str(home)
    try:
        assert main(["run", str(plan), "--out", str(home.parent / "warm-run"), "--quiet"]) == 0
    finally:
        os.environ["LLMPLAN_CACHE"] = old
    return home, plan


def test_a_read_only_warm_cache_runs_and_answers(warm_home: tuple[Path, Path], tmp_path: Path) -> None:
    home, plan = warm_home
    before = snapshot(home)
    os.environ["LLMPLAN_CACHE"], old = str(home), os.environ["LLMPLAN_CACHE"]
    try:
        child = read_only_child(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"], home)
    finally:
        os.environ["LLMPLAN_CACHE"] = old
    assert child.code == 0, child.err[-800:]
    answers = json.loads((tmp_path / "run" / "generations.json").read_text())
    assert answers and all(len(a["tokens"]) == 3 for a in answers)
    assert child.err.count("warning:") <= 1
    assert_clean_message(child.err or "ok")
    assert_untouched(before, home)


def test_a_read_only_cold_cache_refuses_the_import_cleanly(tiny_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "empty-home"
    home.mkdir()
    plan = gguf_plan(tmp_path, tiny_gguf, name="cold")
    os.environ["LLMPLAN_CACHE"], old = str(home), os.environ["LLMPLAN_CACHE"]
    try:
        child = read_only_child(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"], home)
    finally:
        os.environ["LLMPLAN_CACHE"] = old
    assert child.code == 1, child.err[-800:]
    assert_clean_message(child.err, (str(home / "models"), "writable"))
    assert list(home.iterdir()) == []


def test_a_read_only_model_directory_runs_with_one_note(model_dir: Path, tmp_path: Path) -> None:
    """No hash can be recorded there: every run hashes again, said once, and the answer is the same."""
    before = snapshot(model_dir)
    plan = plan_for(tmp_path, model_dir)
    child = read_only_child(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"], model_dir)
    assert child.code == 0, child.err[-800:]
    assert json.loads((tmp_path / "run" / "generations.json").read_text())[0]["tokens"]
    notes = [line for line in child.err.splitlines() if line.startswith("warning:")]
    assert len(notes) == 1 and str(model_dir) in notes[0], child.err
    assert_untouched(before, model_dir)
    assert child.peak_mb < 3072


def test_the_corpus_is_big_enough() -> None:
    """Hostile cases: the parametrized families, plus the single ones (shards-only manifest, GGUF FIFO, GGUF on
    /dev/zero, forged GGUF entry, cache root a file, killed import, reused pid, read-only cold cache)."""
    hostile = len(UNLISTED) + len(FORGED) + len(BAD_KEYS) + len(NOT_OURS) + 8
    assert hostile >= 45, hostile
    assert len({c.id for c in [*UNLISTED, *FORGED, *BAD_KEYS, *NOT_OURS]}) == hostile - 8


def test_timing_of_a_fifo_refusal_is_immediate(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    relist(model_dir, drop=("tokenizer_config.json",))
    _mkfifo(model_dir / "tokenizer_config.json")
    start = time.monotonic()
    run_refused(model_dir, tmp_path, capsys, ("tokenizer_config.json",), seconds=10)
    assert time.monotonic() - start < 5
