"""Issue 33, "never touch what llmplan did not create": every path llmplan writes — a run directory (`--out`
and the default), the `output.write` sinks, a converted checkpoint (`load.convert` `save_to`), `graph -o`,
the report and `bench --out` — is new, or something llmplan wrote and can prove it (llmplan/ownership.py).

Each hostile case plants the user's files, snapshots them byte for byte, and asserts a clean one-line
refusal naming the path, before any work (no model loaded), and the user's files exactly as they were. The
benign twins (the same command again onto what llmplan itself wrote) must still work.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from llmplan.engine.cli import main
from llmplan.llm.formats import write_checkpoint
from llmplan.ownership import NotOurs, check_writable, marker_of, write_file
from tests.trust.checkpoints import make_checkpoint, plan_for
from tests.trust.hostile import assert_clean_message, assert_untouched, refused, snapshot, time_bound

RESULT_SHAPED = {"schema": "llmplan.result/v1", "plan": "trust", "results": [{"id": "0", "text": "mine"}]}
OUTPUT_STAGES = [
    {"id": "post", "uses": "output.postprocess"},
    {"id": "detok", "uses": "output.detokenize"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("writes-model"))


@pytest.fixture(scope="module")
def plan(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return plan_for(tmp_path_factory.mktemp("writes-plan"), model, max_new_tokens=2)


@pytest.fixture(scope="module")
def finished_run(plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory llmplan wrote, once for the module (the report's cases copy it)."""
    out = tmp_path_factory.mktemp("writes-run") / "run"
    assert main(["run", str(plan), "--out", str(out), "--quiet"]) == 0
    return out


def _sink_plan(tmp: Path, model: Path, sinks: list[dict[str, str]], name: str = "sinks") -> Path:
    extra = [*OUTPUT_STAGES, {"id": "write", "uses": "output.write", "with": {"to": sinks}}]
    return plan_for(tmp, model, extra=extra, max_new_tokens=2, name=name)


def _nothing_ran(run_dir: Path, *stages: str) -> None:
    """The refusal came before the work: the load and the generation never started."""
    statuses = {r["id"]: r["status"] for r in json.loads((run_dir / "stages.json").read_text())}
    for stage in stages or ("read", "convert", "generate"):
        assert statuses[stage] == "not_run", statuses


def _seal_like_an_attacker(path: Path) -> None:
    """The marker of the old design, written by hand: the right SHA-256 of the user's file."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "0" * 64
    marker_of(path).write_text(json.dumps({"sha256": digest, "written_by": "llmplan"}) + "\n")


def _forge_new_format(path: Path) -> None:
    """A marker in the current shape with every field right but the seal (no key to make it)."""
    info = os.lstat(path)
    record = {
        "written_by": "llmplan",
        "vouches_for": path.name,
        "kind": "file",
        "dev": info.st_dev,
        "ino": info.st_ino,
        "size": info.st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "mac": "0" * 64,
    }
    marker_of(path).write_text(json.dumps(record) + "\n")


# --- llmplan run --out DIR: an existing directory of the user's ----------------------------------------------


def _user_file(name: str, content: bytes = b"the user's own data\n") -> Callable[[Path], str]:
    def plant(folder: Path) -> str:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
        return Path(name).name

    return plant


def _forged_old_marker(folder: Path) -> str:
    (folder / "metrics.json").write_text('{"my": "metrics"}\n')
    _seal_like_an_attacker(folder / "metrics.json")
    return "metrics.json"


def _forged_new_marker(folder: Path) -> str:
    (folder / "trace.json").write_text('{"traceEvents": []}\n')
    _forge_new_format(folder / "trace.json")
    return "trace.json"


def _link_to_elsewhere(folder: Path) -> str:
    elsewhere = folder.parent / f"{folder.name}-precious.txt"
    elsewhere.write_text("written elsewhere by the user\n")
    (folder / "metrics.json").symlink_to(elsewhere)
    return "metrics.json"


def _fifo(folder: Path) -> str:
    os.mkfifo(folder / "events.jsonl")
    return "events.jsonl"


def _marker_slot_taken(folder: Path) -> str:
    (folder / ".metrics.json.llmplan").write_text("my hidden notes, not a marker\n")
    return ".metrics.json.llmplan"


RUN_DIR_CASES = [
    pytest.param(_user_file("metrics.json", b'{"loss": 0.1}\n'), id="their-metrics.json"),
    pytest.param(_user_file("events.jsonl", b'{"event": "mine"}\n'), id="their-events.jsonl-appended-to"),
    pytest.param(_user_file("trace.json", b'{"traceEvents": [1]}'), id="their-trace.json"),
    pytest.param(_user_file("plan.resolved.yaml", b"name: mine\n"), id="their-plan.resolved.yaml"),
    pytest.param(_user_file("stages.json", b"[]"), id="their-stages.json"),
    pytest.param(_user_file("run.json", b"{}"), id="their-run.json"),
    pytest.param(_user_file("memory.json", b"{}"), id="their-memory.json"),
    pytest.param(_user_file("generations.json", b"[]"), id="their-generations.json"),
    pytest.param(_user_file("traceback.txt", b"my notes"), id="their-traceback.txt"),
    pytest.param(_user_file("report/index.html", b"<p>my page</p>"), id="their-report-page"),
    pytest.param(_user_file("thesis.tex", b"\\documentclass{article}"), id="an-unrelated-thesis.tex"),
    pytest.param(_user_file("notes/deep/a.txt"), id="a-file-in-a-subfolder"),
    pytest.param(_forged_old_marker, id="hand-written-marker-with-the-right-sha256"),
    pytest.param(_forged_new_marker, id="forged-marker-in-the-new-shape"),
    pytest.param(_link_to_elsewhere, id="a-link-named-metrics.json"),
    pytest.param(_fifo, id="a-fifo-named-events.jsonl"),
    pytest.param(_marker_slot_taken, id="their-file-where-a-marker-would-go"),
]


@pytest.mark.parametrize("plant", RUN_DIR_CASES)
def test_out_into_a_directory_of_the_users_is_refused(
    plant: Callable[[Path], str], plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    name = plant(folder)
    before = snapshot(tmp_path)
    refused(["run", str(plan), "--out", str(folder), "--quiet"], capsys, names=[str(folder), name], seconds=30)
    assert_untouched(before, tmp_path)


def test_a_runner_made_elsewhere_refuses_a_directory_of_the_users(plan: Path, tmp_path: Path) -> None:
    """A plugin or a server driving the Runner itself gets the same refusal, as a failed run, with nothing written."""
    from llmplan.engine.cli import new_context
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover
    from llmplan.engine.runner import Runner

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "stages.json").write_text('["my stages"]\n')
    before = snapshot(tmp_path)
    registry = discover()
    bound = load_plan(str(plan), registry)
    result = Runner(bound, new_context(registry, bound), folder).run()
    assert result.exit_code == 1 and result.status == "failed"
    assert_clean_message(result.message, [str(folder), "stages.json"])
    assert_untouched(before, tmp_path)


def test_out_onto_a_file_of_the_users_is_refused(plan: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "important.db"
    target.write_bytes(b"SQLite format 3\x00" + b"\x01" * 100)
    before = snapshot(tmp_path)
    refused(["run", str(plan), "--out", str(target), "--quiet"], capsys, names=[str(target), "not a directory"])
    assert_untouched(before, tmp_path)


def test_out_where_llmplan_wrote_and_the_user_edited_since(plan: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["run", str(plan), "--out", str(out), "--quiet"]) == 0
    with (out / "metrics.json").open("a") as handle:  # the user's notes added to llmplan's file
        handle.write("\n// checked by hand: good run\n")
    before = snapshot(tmp_path)
    refused(["run", str(plan), "--out", str(out), "--quiet"], capsys, names=["metrics.json"])
    assert_untouched(before, tmp_path)


def test_out_copied_with_its_markers_proves_nothing(finished_run: Path, plan: Path, tmp_path: Path, capsys) -> None:
    """A copy of llmplan's run directory, markers and all: every file a new inode, every marker vouching for
    another file. Replacing them would replace the user's copy."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    before = snapshot(tmp_path)
    refused(["run", str(plan), "--out", str(copy), "--quiet"], capsys, names=[str(copy)])
    assert_untouched(before, tmp_path)


def test_rerun_into_the_same_out_is_refused_and_the_first_run_kept(plan: Path, tmp_path: Path, capsys) -> None:
    """(#29) A second run there would replace the first one's files while the results database points at them."""
    out = tmp_path / "run"
    with time_bound(60):
        assert main(["run", str(plan), "--out", str(out), "--quiet"]) == 0
    before = snapshot(out)
    refused(["run", str(plan), "--out", str(out), "--quiet"], capsys, names=[str(out), "earlier run"])
    assert_untouched(before, out)
    events = (out / "events.jsonl").read_text().splitlines()
    assert sum('"run_finished"' in line for line in events) == 1


def test_benign_twin_an_empty_directory_of_the_users_works(plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["run", str(plan), "--out", str(out), "--quiet"]) == 0
    assert (out / "metrics.json").is_file()


# --- the default run directory ------------------------------------------------------------------------------


def _plan_with_runs_dir(plan: Path, runs_dir: Path, tmp: Path) -> Path:
    text = plan.read_text().replace("name: trust\n", f"name: trust\nruns_dir: {json.dumps(str(runs_dir))}\n", 1)
    out = tmp / "with-runs-dir.yaml"
    out.write_text(text)
    return out


def test_runs_dir_that_is_a_file_of_the_users_is_refused(plan: Path, tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    runs.write_text("not a folder: my list of runs\n")
    custom = _plan_with_runs_dir(plan, runs, tmp_path)
    before = snapshot(runs)
    refused(["run", str(custom), "--quiet"], capsys, names=["runs_dir", str(runs)])
    assert_untouched(before, runs)


def test_benign_twin_runs_dir_of_the_users_gets_a_new_run_directory(plan: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "metrics.json").write_text("mine\n")
    (runs / "20260101-000000-trust").mkdir()  # a name make_run_dir could pick: never reused
    (runs / "20260101-000000-trust" / "keep.txt").write_text("keep\n")
    before = snapshot(runs / "metrics.json", runs / "20260101-000000-trust")
    custom = _plan_with_runs_dir(plan, runs, tmp_path)
    assert main(["run", str(custom), "--quiet"]) == 0
    assert_untouched(before, runs / "metrics.json", runs / "20260101-000000-trust")
    assert len([p for p in runs.iterdir() if p.is_dir()]) == 2


# --- output.write sinks ---------------------------------------------------------------------------------------


def _planted_sink(kind: str, name: str, write: Callable[[Path], None]) -> tuple[str, str, Callable[[Path], None]]:
    return kind, name, write


def _bytes(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def _sqlite(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE grades (student TEXT, grade INTEGER)")
        conn.execute("INSERT INTO grades VALUES ('ada', 1)")
    conn.close()


def _old_marker_beside(content: bytes) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        path.write_bytes(content)
        _seal_like_an_attacker(path)

    return plant


def _new_marker_beside(content: bytes) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        path.write_bytes(content)
        _forge_new_format(path)

    return plant


def _marker_of_another(path: Path) -> None:
    """A genuine llmplan marker, for another file with the same content, copied beside the user's copy."""
    other = path.with_name("llmplan-wrote-this.txt")
    write_file(other, "same words\n")
    path.write_text("same words\n")
    shutil.copy(marker_of(other), marker_of(path))


def _replaced_after_llmplan_wrote(path: Path) -> None:
    """llmplan wrote it; then the user saved their own file there (a new inode), same bytes or not."""
    write_file(path, "llmplan's answer\n")
    fresh = path.with_name("draft.txt")
    fresh.write_text("llmplan's answer\n")
    os.replace(fresh, path)


def _edited_after_llmplan_wrote(path: Path) -> None:
    write_file(path, json.dumps(RESULT_SHAPED))
    with path.open("a") as handle:
        handle.write("\n")


def _symlink_to_precious(path: Path) -> None:
    precious = path.with_name("precious.txt")
    precious.write_text("my only copy\n")
    path.symlink_to(precious)


def _marker_is_a_link(path: Path) -> None:
    target = path.with_name("keys.txt")
    target.write_text("my keys\n")
    marker_of(path).symlink_to(target)


def _only_marker_slot_taken(path: Path) -> None:
    marker_of(path).write_text("my hidden notes\n")


SINK_CASES = [
    pytest.param(
        "json", "result.json", _bytes(json.dumps(RESULT_SHAPED).encode()), id="hand-written-result-shaped-json"
    ),
    pytest.param("json", "data.json", _bytes(b'{"experiment": 7}'), id="their-json"),
    pytest.param("json", "important.db", _sqlite, id="an-sqlite-database"),
    pytest.param("text", "notes.txt", _bytes(b"my notes\n"), id="their-text"),
    pytest.param("markdown", "README.md", _bytes(b"# My project\n"), id="their-markdown"),
    pytest.param("text", "notes.txt", _old_marker_beside(b"my notes\n"), id="hand-written-marker-right-sha256"),
    pytest.param(
        "json", "result.json", _old_marker_beside(json.dumps(RESULT_SHAPED).encode()), id="json-with-old-marker"
    ),
    pytest.param("text", "notes.txt", _new_marker_beside(b"my notes\n"), id="forged-marker-new-shape"),
    pytest.param("text", "copy.txt", _marker_of_another, id="a-real-marker-copied-beside-a-copy"),
    pytest.param("text", "answer.txt", _replaced_after_llmplan_wrote, id="llmplan-wrote-then-user-replaced"),
    pytest.param("json", "answer.json", _edited_after_llmplan_wrote, id="llmplan-wrote-then-user-edited"),
    pytest.param("text", "link.txt", _symlink_to_precious, id="a-symlink-to-their-file"),
    pytest.param("json", "folder.json", lambda p: p.mkdir(), id="a-directory"),
    pytest.param("json", "pipe.json", lambda p: os.mkfifo(p), id="a-fifo"),
    pytest.param("text", "fresh.txt", _marker_is_a_link, id="marker-slot-is-a-link"),
    pytest.param("markdown", "fresh.md", _only_marker_slot_taken, id="marker-slot-holds-their-file"),
]


@pytest.mark.parametrize(("kind", "name", "plant"), SINK_CASES)
def test_sink_onto_what_llmplan_did_not_write_is_refused_before_loading(
    kind: str, name: str, plant: Callable[[Path], None], model: Path, tmp_path: Path, capsys
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    target = user / name
    plant(target)
    sink_plan = _sink_plan(tmp_path, model, [{kind: str(target)}])
    before = snapshot(user)
    out = tmp_path / "run"
    refused(["run", str(sink_plan), "--out", str(out), "--quiet"], capsys, names=[str(user)], seconds=30)
    assert_untouched(before, user)
    _nothing_ran(out)


def test_validate_deep_names_a_result_shaped_json(model: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "result.json"
    target.write_text(json.dumps(RESULT_SHAPED))
    sink_plan = _sink_plan(tmp_path, model, [{"json": str(target)}])
    before = snapshot(target)
    said = refused(["validate", "--deep", str(sink_plan)], capsys, names=[str(target)])
    assert "to.0.json" in said
    assert_untouched(before, target)


def test_benign_twin_sinks_rerun_onto_their_own_files(model: Path, tmp_path: Path) -> None:
    paths = {kind: tmp_path / f"out.{ext}" for kind, ext in (("json", "json"), ("text", "txt"), ("markdown", "md"))}
    sink_plan = _sink_plan(tmp_path, model, [{k: str(p)} for k, p in paths.items()])
    for n in range(2):
        assert main(["run", str(sink_plan), "--out", str(tmp_path / f"run{n}"), "--quiet"]) == 0
    assert json.loads(paths["json"].read_text())["schema"] == "llmplan.result/v2"


# --- load.convert save_to: a converted checkpoint -------------------------------------------------------------


def _save_args(plan: Path, target: Path, out: Path) -> list[str]:
    return ["run", str(plan), "--out", str(out), "--quiet", "--set", f"convert.save_to={json.dumps(str(target))}"]


def _thesis_folder(path: Path) -> None:
    path.mkdir()
    (path / "thesis.tex").write_text("\\documentclass{article}\n% two years of work\n")


def _saved_then(change: Callable[[Path], None]) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        write_checkpoint({"w": torch.ones(4)}, path)
        change(path)

    return plant


def _add_thesis(path: Path) -> None:
    (path / "thesis.tex").write_text("my thesis, kept with the weights\n")


def _edit_config(path: Path) -> None:
    with (path / "SHA256SUMS").open("a") as handle:
        handle.write("# checked by me\n")


def _link_to_their_folder(path: Path) -> None:
    theirs = path.with_name("their-folder")
    _thesis_folder(theirs)
    path.symlink_to(theirs, target_is_directory=True)


def _forged_dir_marker(path: Path) -> None:
    _thesis_folder(path)
    marker_of(path).write_text(json.dumps({"sha256": "0" * 64, "written_by": "llmplan", "kind": "directory"}))


def _empty_folder_of_theirs(path: Path) -> None:
    path.mkdir(mode=0o750)


def _marker_slot_of_checkpoint(path: Path) -> None:
    marker_of(path).write_text("a dotfile of mine\n")


CHECKPOINT_CASES = [
    pytest.param(_thesis_folder, id="a-folder-with-thesis.tex"),
    pytest.param(_bytes(b"SQLite format 3\x00" + b"\x00" * 84), id="a-file-important.db"),
    pytest.param(_empty_folder_of_theirs, id="an-empty-folder-of-theirs"),
    pytest.param(_link_to_their_folder, id="a-link-to-their-folder"),
    pytest.param(_saved_then(_add_thesis), id="llmplan-saved-then-thesis-added"),
    pytest.param(_saved_then(_edit_config), id="llmplan-saved-then-a-file-edited"),
    pytest.param(_forged_dir_marker, id="hand-written-directory-marker"),
    pytest.param(_marker_slot_of_checkpoint, id="marker-slot-holds-their-file"),
]


@pytest.mark.parametrize("plant", CHECKPOINT_CASES)
def test_save_to_what_llmplan_did_not_write_is_refused_before_loading(
    plant: Callable[[Path], None], plan: Path, tmp_path: Path, capsys
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    target = user / "converted"
    plant(target)
    before = snapshot(user)
    out = tmp_path / "run"
    said = refused(_save_args(plan, target, out), capsys, names=[str(user), "save_to"], seconds=30)
    assert "convert" in said
    assert_untouched(before, user)
    _nothing_ran(out)


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(_thesis_folder, id="library-thesis-folder"),
        pytest.param(_bytes(b"my database"), id="library-a-file"),
        pytest.param(_saved_then(_add_thesis), id="library-saved-then-thesis-added"),
    ],
)
def test_write_checkpoint_with_overwrite_still_refuses_the_users(plant: Callable[[Path], None], tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    plant(target)
    before = snapshot(tmp_path)
    with pytest.raises(NotOurs) as refusal:
        write_checkpoint({"w": torch.zeros(2)}, target, overwrite=True)
    assert_clean_message(str(refusal.value), [str(target)])
    assert "\n" not in str(refusal.value)
    assert_untouched(before, tmp_path)


def test_benign_twin_save_to_twice_replaces_llmplans_own(plan: Path, tmp_path: Path) -> None:
    target = tmp_path / "converted"
    for n in range(2):
        assert main(_save_args(plan, target, tmp_path / f"run{n}")) == 0
    assert (target / "SHA256SUMS").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".converted")) == [".converted.llmplan"]


# --- llmplan graph -o -----------------------------------------------------------------------------------------


def _keep(suffix: str) -> Callable[[Path], None]:
    return _bytes(f"my own drawing ({suffix}), not to be replaced\n".encode())


GRAPH_CASES = [
    pytest.param("keep.dot", _keep("dot"), id="their-keep.dot"),
    pytest.param("keep.svg", _keep("svg"), id="their-keep.svg"),
    pytest.param("keep.png", _bytes(b"\x89PNG\r\n\x1a\nmine"), id="their-keep.png"),
    pytest.param("keep.mmd", _keep("mmd"), id="their-keep.mmd"),
    pytest.param("keep.dot", _old_marker_beside(b"digraph mine {}\n"), id="their-keep.dot-with-a-forged-marker"),
    pytest.param("keep.dot", _symlink_to_precious, id="a-symlink-keep.dot"),
    pytest.param("keep.svg", lambda p: p.mkdir(), id="a-directory-keep.svg"),
    pytest.param("keep.dot", _only_marker_slot_taken, id="marker-slot-holds-their-file"),
]


@pytest.mark.parametrize(("name", "plant"), GRAPH_CASES)
def test_graph_onto_a_file_of_the_users_is_refused(
    name: str, plant: Callable[[Path], None], plan: Path, tmp_path: Path, capsys
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    plant(user / name)
    before = snapshot(user)
    refused(["graph", str(plan), "-o", str(user / name)], capsys, names=["-o", str(user)])
    assert_untouched(before, user)


@pytest.mark.parametrize("name", ["plan.dot", "plan.svg", "plan.mmd"])
def test_benign_twin_graph_redraws_its_own_file(name: str, plan: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / name
    for _ in range(2):
        assert main(["graph", str(plan), "-o", str(out)]) == 0
    assert out.stat().st_size > 0


# --- the report -----------------------------------------------------------------------------------------------


def _report_plant(relative: str, data: bytes) -> Callable[[Path], None]:
    def plant(report: Path) -> None:
        (report / relative).parent.mkdir(parents=True, exist_ok=True)
        (report / relative).write_bytes(data)

    return plant


REPORT_CASES = [
    pytest.param(_report_plant("index.html", b"<h1>my page</h1>"), id="their-index.html"),
    pytest.param(_report_plant("memory.svg", b"<svg>mine</svg>"), id="their-svg-an-old-build-would-unlink"),
    pytest.param(_report_plant("plan.error.txt", b"my notes"), id="their-error.txt"),
    pytest.param(_report_plant("source/model_graph.svg", b"<svg/>"), id="their-file-in-report-source"),
]


@pytest.mark.parametrize("plant", REPORT_CASES)
def test_report_into_a_folder_of_the_users_is_refused(
    plant: Callable[[Path], None], finished_run: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("report"))
    (run / "report").mkdir()
    plant(run / "report")
    before = snapshot(run / "report")
    refused(["report", str(run)], capsys, names=["report directory", str(run / "report")])
    assert_untouched(before, run / "report")


def test_report_out_into_a_folder_of_the_users_is_refused(finished_run: Path, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "Documents"
    folder.mkdir()
    (folder / "cv.pdf").write_bytes(b"%PDF-1.4 mine")
    before = snapshot(folder)
    refused(["report", str(finished_run), "-o", str(folder)], capsys, names=[str(folder), "cv.pdf"])
    assert_untouched(before, folder)


def test_run_report_into_an_out_with_their_report_is_refused(plan: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    (out / "report").mkdir(parents=True)
    (out / "report" / "index.html").write_text("<p>mine</p>")
    before = snapshot(out)
    refused(["run", str(plan), "--out", str(out), "--quiet", "--report"], capsys, names=["index.html"])
    assert_untouched(before, out)


def test_benign_twin_report_twice_on_the_same_run(finished_run: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("report"))
    for _ in range(2):
        assert main(["report", str(run)]) == 0
    assert (run / "report" / "index.html").is_file()


# --- bench --out PREFIX ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "suffix", [pytest.param(".json", id="their-PREFIX.json"), pytest.param(".md", id="their-PREFIX.md")]
)
def test_bench_out_onto_their_files_is_refused_before_measuring(
    suffix: str, plan: Path, tmp_path: Path, capsys
) -> None:
    prefix = tmp_path / "results"
    prefix.with_suffix(suffix).write_text("my measurements\n")
    before = snapshot(tmp_path)
    refused(["bench", str(plan), "--out", str(prefix)], capsys, names=["--out", str(prefix.with_suffix(suffix))])
    assert_untouched(before, tmp_path)


# --- the marker itself ----------------------------------------------------------------------------------------


def test_a_marker_sealed_under_another_key_proves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's (or another machine's) llmplan wrote it: this llmplan cannot prove it did."""
    target = tmp_path / "out.txt"
    monkeypatch.setenv("LLMPLAN_STATE_HOME", str(tmp_path / "other-state"))
    write_file(target, "written under the other key\n")
    monkeypatch.setenv("LLMPLAN_STATE_HOME", str(tmp_path / "my-state"))
    before = snapshot(target, marker_of(target))
    with pytest.raises(NotOurs, match="not a file llmplan wrote"):
        check_writable(target)
    assert_untouched(before, target, marker_of(target))


def test_another_model_cache_keeps_what_llmplan_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key is the user's, not one model cache's: `make run` wrote out/, then the tests (their own
    LLMPLAN_CACHE) run the same plan — the earlier output is still llmplan's to replace."""
    target = tmp_path / "out.txt"
    monkeypatch.setenv("LLMPLAN_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("LLMPLAN_CACHE", str(tmp_path / "first-cache"))
    write_file(target, "first run\n")
    monkeypatch.setenv("LLMPLAN_CACHE", str(tmp_path / "second-cache"))
    check_writable(target)  # raises NotOurs if ownership were tied to the model cache
    write_file(target, "second run\n")
    assert target.read_text() == "second run\n"


def test_a_huge_marker_is_not_read(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("mine\n")
    marker_of(target).write_bytes(b'{"mac": "' + b"0" * (8 << 20) + b'"}')
    before = snapshot(tmp_path)
    with time_bound(5), pytest.raises(NotOurs):
        check_writable(target)
    assert_untouched(before, tmp_path)
