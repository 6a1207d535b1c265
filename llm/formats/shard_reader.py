"""Read a checkpoint's tensors shard by shard, holding at most `buffer_shards` shards in host memory.

A producer thread reads shards in order (mmap-backed `safe_open`, or `torch.load(weights_only=True,
mmap=True)` for `.bin`/`.pth`) and clones the wanted tensors out of the mapping, so the file can be closed.
The consumer (the caller's thread) hands each tensor to `on_tensor` or keeps it in the result. A semaphore
with `buffer_shards` permits is taken before a shard is read and given back once the consumer has taken all
of its tensors, so a shard being read, one waiting, and one being consumed all count: with `on_tensor`
converting each fp32 tensor as it arrives, peak host memory is (final weights + N shards), not
(all shards x 2). Run `checkpoint.verify` first: this module trusts sizes and hashes, not pickles.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from pickle import UnpicklingError

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from ..trust.checkpoint import IntegrityError, ShardInfo, ShardManifest

TensorFn = Callable[[str, Tensor], None]
ProgressFn = Callable[[int], None]

_POLL_S = 0.05
_SHOW_MISSING = 5


class MissingTensorsError(IntegrityError):
    """Wanted tensors that the checkpoint does not contain; `missing` lists all of them."""

    def __init__(self, model_dir: Path, missing: list[str]) -> None:
        self.missing = sorted(missing)
        shown = ", ".join(self.missing[:_SHOW_MISSING])
        more = f", … (+{len(self.missing) - _SHOW_MISSING} more)" if len(self.missing) > _SHOW_MISSING else ""
        super().__init__(f"{model_dir}: {len(self.missing)} wanted tensor(s) not in the checkpoint: {shown}{more}")


@dataclass(frozen=True)
class ShardStats:
    name: str
    bytes: int
    """Bytes of the tensors taken from this shard (skipped tensors are never materialised)."""
    seconds: float
    tensors: int


@dataclass
class ReadResult:
    tensors: dict[str, Tensor]
    """Empty when `on_tensor` consumed them."""
    skipped: list[str]
    shards: list[ShardStats]
    peak_buffer_bytes: int
    peak_buffer_shards: int
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(stats.bytes for stats in self.shards)


@dataclass
class _Loaded:
    stats: ShardStats
    tensors: dict[str, Tensor]
    skipped: list[str]


@dataclass
class _Failed:
    error: BaseException


_DONE = object()


@dataclass
class _Buffer:
    """The bounded read-ahead: permits for shards in flight, and a count of the bytes they hold."""

    capacity: int
    bytes: int = 0
    shards: int = 0
    peak_bytes: int = 0
    peak_shards: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _permits: threading.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self._permits = threading.BoundedSemaphore(self.capacity)

    def take_shard(self, stop: threading.Event) -> bool:
        while not self._permits.acquire(timeout=_POLL_S):
            if stop.is_set():
                return False
        with self._lock:
            self.shards += 1
            self.peak_shards = max(self.peak_shards, self.shards)
        return True

    def give_shard(self) -> None:
        with self._lock:
            self.shards -= 1
        self._permits.release()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def remove(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes


def read_shards(
    manifest: ShardManifest,
    wanted: set[str] | None = None,
    buffer_shards: int = 1,
    on_tensor: TensorFn | None = None,
    progress: ProgressFn | None = None,
) -> ReadResult:
    """Read the `wanted` tensors (all when None); names not wanted are skipped and listed.

    `on_tensor(name, tensor)` is called in the caller's thread, in shard order; when given, the result's
    `tensors` stays empty so the caller decides what to keep. `progress(nbytes)` follows each tensor.
    """
    if buffer_shards < 1:
        raise ValueError(f"buffer_shards must be >= 1 (got {buffer_shards})")
    start = time.perf_counter()
    plan, skipped = _shard_plan(manifest, wanted)
    buffer = _Buffer(buffer_shards)
    results: queue.Queue[object] = queue.Queue()
    stop = threading.Event()
    producer = threading.Thread(
        target=_produce,
        args=(manifest, plan, wanted, buffer, results, stop),
        name="shard-reader",
        daemon=True,
    )
    tensors: dict[str, Tensor] = {}
    seen: dict[str, str] = {}
    stats: list[ShardStats] = []
    producer.start()
    try:
        while (item := results.get()) is not _DONE:
            if isinstance(item, _Failed):
                raise item.error
            assert isinstance(item, _Loaded)
            skipped.extend(item.skipped)
            take = on_tensor if on_tensor is not None else tensors.__setitem__
            _hand_over(manifest, item, seen, buffer, take, progress)
            stats.append(item.stats)
            buffer.give_shard()
    finally:
        stop.set()
        producer.join()
    if wanted is not None:  # a `.bin` has no index to check up front
        missing = wanted - seen.keys()
        if missing:
            raise MissingTensorsError(manifest.model_dir, list(missing))
    return ReadResult(
        tensors=tensors,
        skipped=skipped,
        shards=stats,
        peak_buffer_bytes=buffer.peak_bytes,
        peak_buffer_shards=buffer.peak_shards,
        seconds=time.perf_counter() - start,
    )


def _shard_plan(manifest: ShardManifest, wanted: set[str] | None) -> tuple[list[ShardInfo], list[str]]:
    """(the shards to open, the tensor names skipped by not opening the others); MissingTensorsError before
    anything is read when the index already says a wanted tensor is absent."""
    known = manifest.tensor_to_shard
    if wanted is None or not known:
        return manifest.shards, []
    missing = wanted - known.keys()
    if missing:
        raise MissingTensorsError(manifest.model_dir, list(missing))
    # shards holding nothing wanted are not even opened
    needed = {known[name] for name in wanted}
    plan = [shard for shard in manifest.shards if shard.name in needed]
    return plan, [name for name, shard in known.items() if shard not in needed]


def _hand_over(
    manifest: ShardManifest,
    item: _Loaded,
    seen: dict[str, str],
    buffer: _Buffer,
    take: TensorFn,
    progress: ProgressFn | None,
) -> None:
    """Give each tensor of a loaded shard to `take`, in order, freeing its room in the buffer as it leaves;
    a tensor already seen in another shard is an IntegrityError."""
    for name in list(item.tensors):
        tensor = item.tensors.pop(name)  # drop the buffer's reference as the tensor leaves it
        if name in seen:
            raise IntegrityError(f"{manifest.model_dir}: tensor {name!r} is in both {seen[name]} and {item.stats.name}")
        seen[name] = item.stats.name
        nbytes = tensor.nbytes
        take(name, tensor)
        del tensor
        buffer.remove(nbytes)
        if progress is not None:
            progress(nbytes)


def _produce(
    manifest: ShardManifest,
    plan: list[ShardInfo],
    wanted: set[str] | None,
    buffer: _Buffer,
    results: queue.Queue[object],
    stop: threading.Event,
) -> None:
    try:
        for shard in plan:
            if not buffer.take_shard(stop):
                return
            began = time.perf_counter()
            tensors: dict[str, Tensor] = {}
            skipped: list[str] = []
            nbytes = 0
            for name, tensor in _iter_shard(manifest, shard, wanted, skipped):
                if stop.is_set():
                    return
                # Clone out of the mapping so the file can be closed and its pages dropped.
                owned = tensor.clone()
                del tensor
                buffer.add(owned.nbytes)
                nbytes += owned.nbytes
                tensors[name] = owned
            stats = ShardStats(shard.name, nbytes, time.perf_counter() - began, len(tensors))
            results.put(_Loaded(stats, tensors, skipped))
        results.put(_DONE)
    except BaseException as exc:  # handed to the consumer, which re-raises it in the caller's thread
        results.put(_Failed(exc))


def _iter_shard(
    manifest: ShardManifest, shard: ShardInfo, wanted: set[str] | None, skipped: list[str]
) -> Iterator[tuple[str, Tensor]]:
    """Yield the wanted (name, mmap-backed tensor) pairs of one shard; append the others to `skipped`."""
    if manifest.format == "safetensors":
        try:
            with safe_open(str(shard.path), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    if wanted is None or name in wanted:
                        yield name, handle.get_tensor(name)
                    else:
                        skipped.append(name)
        except SafetensorError as exc:
            raise IntegrityError(f"{shard.path}: cannot read as safetensors: {_one_line(exc)}") from None
        return
    state = _load_torch(shard.path)
    for name in list(state):
        tensor = state.pop(name)
        if wanted is None or name in wanted:
            yield name, tensor
        else:
            skipped.append(name)
        del tensor


def _load_torch(path: Path) -> dict[str, Tensor]:
    """A `.bin`/`.pth` state dict, unpickled with weights_only=True: no code in the file ever runs."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except UnpicklingError as exc:
        detail = re.search(r"WeightsUnpickler error: (.*?)(?:\. |\.?$)", str(exc), re.MULTILINE)
        reason = detail.group(1) if detail else _one_line(exc)
        raise IntegrityError(
            f"{path}: refused to unpickle: {reason} (only tensors are allowed; convert it to safetensors)"
        ) from None
    except RuntimeError as exc:  # e.g. legacy (non-zip) files, which cannot be memory-mapped
        raise IntegrityError(f"{path}: cannot load as a torch state dict: {_one_line(exc)}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise IntegrityError(f"{path}: not a state dict of name -> tensor")
    return state


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
