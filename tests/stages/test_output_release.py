from __future__ import annotations

import torch

from llmplan.engine.memory import rss_bytes
from llmplan.stages.output_release import OutputRelease, ReleaseParams
from llmplan.stages.types import ConvertedWeights, HostWeights

MIB = 1 << 20


class _Reader:
    closed = False

    def close(self) -> None:
        self.closed = True


class _Cache(_Reader):
    def __init__(self) -> None:
        self.k = torch.ones(MIB, dtype=torch.float32)


def _fill(ctx, nbytes: int) -> None:
    # torch.ones touches every page, so the memory is really resident.
    ctx.weights = ConvertedWeights({"w": torch.ones(nbytes // 4, dtype=torch.float32)}, "float32", nbytes)
    ctx.model = torch.nn.Linear(4, 4)
    ctx.kv_cache = _Cache()


def test_release_frees_real_memory(ctx, capsys):
    _fill(ctx, 256 * MIB)
    cache = ctx.kv_cache
    ctx.host_weights = HostWeights(stream=lambda on_tensor: None, wanted=[], buffer_shards=1)
    before = rss_bytes()
    OutputRelease().run(ctx, ReleaseParams())
    report = ctx.release_report
    assert ctx.model is None and ctx.weights is None and ctx.kv_cache is None and ctx.host_weights is None
    assert cache.closed  # what holds handles is closed, not just dropped
    del cache
    assert report["released"] == ["model", "weights", "kv_cache", "host_weights"]
    assert report["freed_bytes"] >= 200 * MIB, report
    assert rss_bytes() < before - 200 * MIB
    err = capsys.readouterr().err
    assert err.startswith("released model, weights, kv_cache, host_weights: RSS ") and " → " in err
    assert ctx.metrics.get("run", "freed_bytes") == report["freed_bytes"]


def test_keep_weights_and_json_mode(ctx, capsys):
    _fill(ctx, 4 * MIB)
    ctx.json_mode = True
    OutputRelease().run(ctx, ReleaseParams(keep_weights=True))
    assert ctx.model is not None and ctx.weights is not None and ctx.kv_cache is None
    assert ctx.release_report["released"] == ["kv_cache"]
    assert capsys.readouterr() == ("", "")


def test_nothing_to_release(ctx, capsys):
    OutputRelease().run(ctx, ReleaseParams())
    assert ctx.release_report["released"] == []
    assert capsys.readouterr().err.startswith("released nothing: RSS")
