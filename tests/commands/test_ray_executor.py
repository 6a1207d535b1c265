"""`llmplan run --executor ray` on a real local Ray cluster (2 CPUs), a tiny random Llama, 40 prompts.

Nothing of Ray is mocked: the replicas are Ray Data actors in their own processes; one of them is killed
with SIGKILL half-way through a run.
"""

from __future__ import annotations

import collections
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.stages.tiny_run import load_stages, make_tiny_model_dir

ray = pytest.importorskip("ray")

PROMPTS = 40
WORDS = ["model", "cache", "token", "layer", "注意力", "hello", "world", "言語", "prompt", "text"]


@pytest.fixture(scope="module")
def cluster() -> Any:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage-stats prompt or upload from a test
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ray")
    model_dir, _ = make_tiny_model_dir(root, n_layers=2)
    prompts = root / "prompts.jsonl"
    lines = [
        {
            "id": f"p{i:02d}",
            "messages": [{"role": "user", "content": " ".join(WORDS[(i + j) % 10] for j in range(1 + i % 7))}],
        }
        for i in range(PROMPTS)
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(lines), root / "prompts.parquet")  # the same set, as Parquet
    plan = {
        "name": "tiny-ray",
        "device": "cpu",
        "seed": 0,
        "threads": 1,
        "observe": {"memory_interval_ms": 0},
        "executor": {"kind": "local", "batch_size": 4},
        "stages": [
            *load_stages(model_dir),
            {"id": "prompt", "uses": "compute.tokenize", "with": {"text": "placeholder"}},
            {
                "id": "generate",
                "uses": "compute.generate",
                "with": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": False},
            },
            {"id": "lookup", "uses": "cache.lookup", "with": {"db": str(root / "unused.sqlite"), "mode": "reuse"}},
            {"id": "clean", "uses": "output.postprocess"},
            {"id": "text", "uses": "output.detokenize"},
            {"id": "write", "uses": "output.write", "with": {"to": [{"json": str(root / "local.json")}]}},
            {"id": "store", "uses": "output.cache", "with": {"db": str(root / "unused.sqlite")}},
        ],
    }
    path = root / "tiny-ray.yaml"
    path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return {"root": root, "plan": path, "prompts": prompts, "parquet": root / "prompts.parquet"}


def _db(setup: dict[str, Path], name: str) -> list[str]:
    db = setup["root"] / f"{name}.sqlite"
    return ["--set", f"lookup.db={db}", "--set", f"store.db={db}"]


def _local(setup: dict[str, Path], name: str, *extra: str) -> dict[str, dict[str, Any]]:
    """The local executor's answers, by request id."""
    from llmplan.engine.cli import main

    out = setup["root"] / f"local-{name}.json"
    args = ["run", str(setup["plan"]), "--prompts", str(setup["prompts"]), "--quiet", *_db(setup, f"local-{name}")]
    args += ["--out", str(setup["root"] / f"run-local-{name}"), "--set", f"write.to=[{{json: {out}}}]", *extra]
    assert main(args) == 0
    return {r["id"]: r for r in json.loads(out.read_text(encoding="utf-8"))["results"]}


def _ray_args(setup: dict[str, Path], run: str, db: str, *extra: str, prompts: str = "prompts") -> list[str]:
    return [
        "run", str(setup["plan"]), "--prompts", str(setup[prompts]), "--quiet", "--executor", "ray",
        "--replicas", "2", "--threads-per-replica", "1", "--out", str(setup["root"] / run), *_db(setup, db), *extra,
    ]  # fmt: skip


def _shards(run_dir: Path) -> list[dict[str, Any]]:
    from llmplan.commands.ray.result_shards import read_shards

    return read_shards(run_dir)


def _executor_metrics(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))["executor"]


def _exactly_once(results: list[dict[str, Any]]) -> None:
    counts = collections.Counter(r["id"] for r in results)
    assert sorted(counts) == [f"p{i:02d}" for i in range(PROMPTS)]
    assert set(counts.values()) == {1}


def test_ray_run_equals_local_then_rerun_generates_nothing(cluster: Any, setup: dict[str, Path]) -> None:
    from llmplan.engine.cli import main

    local = _local(setup, "plain")
    document = setup["root"] / "ray-1.json"
    assert main(_ray_args(setup, "ray-1", "ray", "--set", f"write.to=[{{json: {document}}}]")) == 0
    results = _shards(setup["root"] / "ray-1")
    _exactly_once(results)
    # The plan's JSON file sink gets the whole set in request order, as the local run wrote it.
    written = json.loads(document.read_text(encoding="utf-8"))["results"]
    assert [r["id"] for r in written] == list(local)
    assert [r["tokens"] for r in written] == [r["tokens"] for r in local.values()]
    for result in results:  # fp32 greedy: token for token what one process generates
        assert result["tokens"] == local[result["id"]]["tokens"], result["id"]
        assert result["text"] == local[result["id"]]["text"]
        assert result["from_cache"] is False
    metrics = _executor_metrics(setup["root"] / "ray-1")
    assert metrics["generated_requests"] == PROMPTS and metrics["replayed"] == 0
    assert metrics["generated_tokens"] == PROMPTS * 12
    assert metrics["key_mismatches"] == 0
    assert len(metrics["replicas_seen"]) == 2  # two replica processes answered
    assert sum(metrics["replicas_seen"].values()) == PROMPTS

    # The same set again, as Parquet: every answer comes from the results database, nothing is generated.
    assert main(_ray_args(setup, "ray-2", "ray", prompts="parquet")) == 0
    again = _shards(setup["root"] / "ray-2")
    _exactly_once(again)
    assert all(r["from_cache"] for r in again)
    assert {r["id"]: r["tokens"] for r in again} == {r["id"]: r["tokens"] for r in results}
    metrics = _executor_metrics(setup["root"] / "ray-2")
    assert (metrics["replayed"], metrics["generated_requests"], metrics["generated_tokens"]) == (PROMPTS, 0, 0)
    assert "cluster_s" not in metrics  # no replica was started


def test_a_replica_killed_mid_run_loses_nothing(
    cluster: Any, setup: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from llmplan.commands.ray.executor import execute
    from llmplan.engine.cli import build_parser, plan_overrides
    from llmplan.engine.executors import ExecutorJob
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover
    from llmplan.engine.yaml_source import load_file

    # Longer answers, one at a time per replica: the run lasts long enough to kill a replica in the middle.
    slow = [
        *("--set", "generate.max_new_tokens=200", "--set", "place.kv_cache.max_tokens=256"),
        *("--set", "generate.batch_size=1", "--set", "executor.batch_size=2"),
    ]
    local = _local(setup, "slow", *slow)
    args = build_parser().parse_args(_ray_args(setup, "ray-killed", "killed", *slow))
    registry = discover()
    overrides = plan_overrides(args, registry, load_file(args.plan))
    bound = load_plan(args.plan, registry, overrides)
    run_dir = Path(args.out)
    run_dir.mkdir()
    killed: dict[str, Any] = {}

    def kill_once(replica: str, written: int) -> None:
        if not killed:
            pid = replica_pid(replica)
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, written=written)

    job = ExecutorJob(bound, registry, run_dir, overrides, json_mode=True, quiet=True)
    assert execute(job, on_batch=kill_once) == 0
    # stdout is the results, one line each, whatever Ray said about the retried batches (that is in ray.log)
    assert sorted(json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()) == sorted(local)
    results = _shards(run_dir)
    _exactly_once(results)
    assert killed and killed["written"] <= PROMPTS // 2  # the kill came half-way at the latest
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)
    for result in results:
        assert result["tokens"] == local[result["id"]]["tokens"], result["id"]
    metrics = _executor_metrics(run_dir)
    assert metrics["generated_requests"] == PROMPTS
    assert f":{killed['pid']}" in " ".join(metrics["replicas_seen"])


def test_a_replica_that_cannot_load_is_one_line(
    cluster: Any, setup: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from llmplan.engine.cli import main

    # The driver never verifies shards (it loads no weights); every replica does, and this one cannot.
    assert main(_ray_args(setup, "ray-broken", "broken", "--set", "verify.hashes=required")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        err.strip().splitlines()[-1].startswith("ray executor: loading the plan failed: stage 'verify' (load.verify): ")
    ), err


def replica_pid(replica: str) -> int:
    """The pid Ray's actor table gives the live actor that answered as `replica` ("host:pid", its own word)."""
    from ray._private import state  # the GCS actor table: the public state API needs the dashboard

    pid = int(replica.rsplit(":", 1)[1])
    alive = {
        a["Pid"] for a in state.actors().values() if a["State"] == "ALIVE" and "PlanReplica" in a["ActorClassName"]
    }
    assert pid in alive, (pid, alive)
    return pid
