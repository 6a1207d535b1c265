"""Corpus: messages. Whatever goes wrong, the user reads one sentence naming the file, field or flag —
never an exception class name (outside --debug), never a traceback, and never their own text read as
console markup.

Families: rich markup and emoji codes in paths, prompts and --set values (shown as written, no
MarkupError, the run still works); integers past Python's 4300-digit limit in a plan, a --set and a
prompts file; a disk that fills up (writes that fail with ENOSPC, simulated by handing the writer
/dev/full) at the start, in a sink and while writing the run's records; library exceptions that reach
the last-resort handler (a real SafetensorError, RecursionError, UnicodeDecodeError, MemoryError,
KeyError), each said as a plain sentence naming the file.
"""

from __future__ import annotations

import errno
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from llmplan.engine.cli import main
from llmplan.plain_errors import plain_error

from .checkpoints import make_checkpoint, plan_for
from .hostile import assert_clean_message, assert_untouched, memory_bound, refused, snapshot, time_bound

MARKUP = ["[/dim]", "[bold red]", "[/]", "[link=file:///etc/passwd]x[/link]", ":smile:", "[red]\\[x]"]
LONG = "7" * 5000  # past Python's int/str conversion limit (4300 digits)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def run_ok(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """A run that must work (the benign twin): exit 0 within bounds; returns stderr."""
    capsys.readouterr()
    with time_bound(60), memory_bound(1024):
        code = main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err[-600:]
    assert "Traceback" not in out.err
    return out.err


def write_plan(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


# --- user text is never console markup ---------------------------------------------------------------


@pytest.mark.parametrize("markup", MARKUP)
def test_markup_in_the_run_directory_is_shown_as_written(
    pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], markup: str
) -> None:
    plan = plan_for(tmp_path, pristine)
    out = tmp_path / f"run {markup} end"
    prompt = f"Say {markup} back"
    said = run_ok(["run", str(plan), "--out", str(out), "--prompt", prompt], capsys)
    assert f"run directory: {out}" in said  # literally, brackets and colons included
    assert (out / "run.json").is_file()


@pytest.mark.parametrize(
    "stage_id",
    [
        pytest.param("[/dim]", id="closing-tag"),
        pytest.param("[bold red]x", id="style"),
        pytest.param(":x:", id="emoji"),
    ],
)
def test_stage_lines_show_ids_and_reasons_as_written(stage_id: str) -> None:
    from llmplan.engine.console import print_stage
    from llmplan.engine.runner import StageRecord

    console = Console(file=io.StringIO(), width=200, highlight=False, markup=False, emoji=False)
    for status, reason in (("ok", ""), ("skipped", f"because {stage_id}"), ("failed", "")):
        record = StageRecord(stage_id, f"uses{stage_id}", "load", status, reason=reason)
        print_stage(record, console)
    shown = console.file.getvalue()
    assert shown.count(stage_id) >= 3 and f"because {stage_id}" in shown


def test_progress_descriptions_are_not_markup() -> None:
    from llmplan.engine.console import RichProgress

    console = Console(file=io.StringIO(), width=200, force_terminal=True)
    with RichProgress(console).task("hashing [/dim] model[bold].safetensors", total=10) as advance:
        advance(10)  # rich raised MarkupError here, at render time


@pytest.mark.parametrize(
    ("name", "said"),
    [
        pytest.param("plan [/dim].yaml", "file not found", id="missing-plan"),
        pytest.param("[bold red]plan.yaml", "file not found", id="styled-missing-plan"),
    ],
)
def test_markup_in_a_plan_path_of_a_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, said: str
) -> None:
    text = refused(["run", str(tmp_path / name)], capsys, names=[str(tmp_path / name), said])
    assert text.count(str(tmp_path / name)) == 1


def test_markup_in_a_model_path_of_a_refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "[/dim]weights[bold red]"
    plan = plan_for(tmp_path, missing)
    refused(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"], capsys, names=[str(missing)])


def test_markup_in_a_set_key_of_a_refusal(pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_for(tmp_path, pristine)
    refused(["validate", str(plan), "--set", "[/dim].x=1"], capsys, names=["[/dim]"])


# --- integers past Python's digit limit ------------------------------------------------------------------


def _plan_data(tmp_path: Path, pristine: Path) -> dict[str, Any]:
    return yaml.safe_load(plan_for(tmp_path, pristine).read_text(encoding="utf-8"))


LONG_INTEGER_PLANS: list[Any] = [
    pytest.param(lambda d: d["stages"][-1]["with"].__setitem__("max_new_tokens", "LONG"), id="max-new-tokens"),
    pytest.param(lambda d: d["stages"][-1]["with"].__setitem__("seed", "-LONG"), id="negative"),
    pytest.param(lambda d: d.__setitem__("seed", "LONG"), id="top-level-seed"),
    pytest.param(lambda d: d["stages"][-1]["with"].__setitem__("stop", ["a", "LONG"]), id="inside-a-list"),
    pytest.param(lambda d: d["observe"].__setitem__("memory_interval_ms", "LONG"), id="observe-block"),
]


@pytest.mark.parametrize("edit", LONG_INTEGER_PLANS)
def test_a_long_integer_in_a_plan(
    pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[dict[str, Any]], None]
) -> None:
    data = _plan_data(tmp_path, pristine)
    edit(data)
    plan = tmp_path / "long.yaml"
    plan.write_text(yaml.safe_dump(data, sort_keys=False).replace("'LONG'", LONG).replace("LONG", LONG))
    before = snapshot(plan)
    for command in ("validate", "run"):
        said = refused([command, str(plan)], capsys, names=[f"{plan}:", "digits"], seconds=20)
        assert "Exceeds the limit" not in said and len(said) < 1000
    assert_untouched(before, plan)


@pytest.mark.parametrize(
    "override",
    [
        pytest.param(f"generate.max_new_tokens={LONG}", id="stage-param"),
        pytest.param(f"seed={LONG}", id="plan-key"),
        pytest.param(f"generate.stop=[{LONG}]", id="in-a-list"),
    ],
)
def test_a_long_integer_in_set(
    pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str
) -> None:
    plan = plan_for(tmp_path, pristine)
    for command in ("validate", "run"):
        said = refused([command, str(plan), "--set", override], capsys, names=["--set", "digits"], seconds=20)
        assert "Exceeds the limit" not in said and len(said) < 1000


def test_a_long_integer_in_a_prompts_file(pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(f'{{"text": "hi", "max_tokens": {LONG}}}\n', encoding="utf-8")
    plan = plan_for(tmp_path, pristine)
    argv = ["run", str(plan), "--prompts", str(prompts), "--until", "prompt", "--out", str(tmp_path / "r"), "--quiet"]
    said = refused(argv, capsys, names=[f"{prompts}:1", "digits"], seconds=30)
    assert "Exceeds the limit" not in said


def test_a_deeply_nested_set_value(pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_for(tmp_path, pristine)
    refused(["validate", str(plan), "--set", "prompt.text=" + "[" * 5000], capsys, names=["--set", "nesting"])


# --- the disk fills up -----------------------------------------------------------------------------------


def full_disk(monkeypatch: pytest.MonkeyPatch, matching: Callable[[str], bool]) -> None:
    """Writes to files whose name `matching` accepts go to /dev/full, which fails them with ENOSPC as a
    full disk does (on write or flush, not on open); the file itself is left as opened (empty)."""
    real_fdopen = os.fdopen

    def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if matching(name):
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, fd)
            os.close(full)
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", fdopen)


@pytest.mark.parametrize(
    ("which", "named"),
    [
        pytest.param(lambda name: True, "plan.resolved.yaml", id="from-the-start"),
        pytest.param(lambda name: "answers.json" in name, "answers.json", id="a-json-sink"),
        pytest.param(lambda name: "stages.json" in name, "stages.json", id="the-run-records"),
        pytest.param(lambda name: "trace.json" in name, "trace.json", id="the-trace"),
    ],
)
def test_disk_full(
    pristine: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    which: Callable[[str], bool],
    named: str,
) -> None:
    sink = {"id": "write", "uses": "output.write", "with": {"to": [{"json": str(tmp_path / "answers.json")}]}}
    plan = plan_for(
        tmp_path,
        pristine,
        extra=[{"id": "clean", "uses": "output.postprocess"}, {"id": "text", "uses": "output.detokenize"}, sink],
    )
    before = snapshot(pristine, plan)
    full_disk(monkeypatch, which)
    said = refused(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"], capsys, names=[named], seconds=60)
    assert "space" in said and "Errno" not in said
    monkeypatch.undo()
    assert_untouched(before, pristine, plan)


# --- library exceptions that reach the last-resort handler -----------------------------------------------


def _garbage_safetensors(tmp_path: Path) -> Path:
    path = tmp_path / "garbage.safetensors"
    path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")  # a header length past the file
    return path


def _raise_safetensor_error(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = _garbage_safetensors(tmp_path)
    with safe_open(str(path), framework="pt"):
        pass


def _raise_recursion(tmp_path: Path) -> None:
    path = tmp_path / "nested.json"
    path.write_text("[" * 200000 + "]" * 200000)
    json.loads(path.read_text())


def _raise_unicode(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    path.read_text(encoding="utf-8")


def _raise_memory(tmp_path: Path) -> None:
    raise MemoryError


def _raise_key(tmp_path: Path) -> None:
    raise KeyError("model.layers.0.weight")


def _raise_long_int(tmp_path: Path) -> None:
    int(LONG)


def _raise_eacces(tmp_path: Path) -> None:
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "locked.bin"))


def _raise_erofs(tmp_path: Path) -> None:
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "ro" / "cache.db"))


LIBRARY_FAILURES = [
    pytest.param(_raise_safetensor_error, ["garbage.safetensors", "safetensors file"], id="safetensor-error"),
    pytest.param(_raise_recursion, ["nested.json", "nested too deeply"], id="recursion-error"),
    pytest.param(_raise_unicode, ["latin1.txt", "UTF-8"], id="unicode-decode-error"),
    pytest.param(_raise_memory, ["out of memory"], id="memory-error"),
    pytest.param(_raise_key, ["model.layers.0.weight", "--debug"], id="key-error"),
    pytest.param(_raise_long_int, ["digits"], id="long-int-conversion"),
    pytest.param(_raise_eacces, ["locked.bin", "permission denied"], id="permission-denied"),
    pytest.param(_raise_erofs, ["cache.db", "read-only"], id="read-only-file-system"),
]


@pytest.mark.parametrize(("failure", "names"), LIBRARY_FAILURES)
def test_a_library_exception_in_a_stage(
    pristine: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    failure: Callable[[Path], None],
    names: list[str],
) -> None:
    """A stage that lets a library's exception escape (as a new bug would): the run says one sentence."""
    from llmplan.stages.load_tokenizer import LoadTokenizer

    monkeypatch.setattr(LoadTokenizer, "run", lambda self, ctx, params: failure(tmp_path))
    plan = plan_for(tmp_path, pristine)
    run_dir = tmp_path / "run"
    said = refused(["run", str(plan), "--out", str(run_dir), "--quiet"], capsys, names=names, seconds=30)
    assert said.startswith("error: stage 'tokenizer' (load.tokenizer): ")
    assert (run_dir / "traceback.txt").is_file()  # the details are kept, for a bug report
    assert json.loads((run_dir / "run.json").read_text())["message"] in said


@pytest.mark.parametrize(("failure", "names"), LIBRARY_FAILURES)
def test_a_library_exception_in_a_command(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    failure: Callable[[Path], None],
    names: list[str],
) -> None:
    """The CLI's last-resort handler (a command that fails outside any run) says the same sentence."""
    from llmplan.engine import cli

    monkeypatch.setattr(cli, "cmd_schema", lambda args: failure(tmp_path))  # the parser binds it when built
    said = refused(["schema"], capsys, names=names, seconds=30)
    assert said.startswith("error: ") and said.count("\n") == 1


def test_debug_still_shows_the_exception(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplan.engine import cli

    monkeypatch.setattr(cli, "cmd_schema", lambda args: _raise_key(Path("/")))
    with pytest.raises(KeyError):
        main(["--debug", "schema"])


# --- plain_error itself: the sentences, without a run --------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "said"),
    [
        pytest.param(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "no space left", id="enospc-bare"),
        pytest.param(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/q/f"), "/q/f: disk quota", id="edquot"),
        pytest.param(OSError(errno.EMFILE, os.strerror(errno.EMFILE)), "ulimit -n", id="too-many-open-files"),
        pytest.param(OSError(errno.EIO, os.strerror(errno.EIO), "/mnt/x"), "/mnt/x: input/output", id="eio"),
        pytest.param(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), "out of memory", id="cuda-oom"),
        pytest.param(ValueError("JSONDecodeError in ValueError"), "error in error", id="names-scrubbed"),
        pytest.param(RuntimeError(""), "no details", id="empty-message"),
        pytest.param(RuntimeError("x" * 5000), "…", id="very-long-message"),
    ],
)
def test_plain_error_sentences(error: BaseException, said: str) -> None:
    text = plain_error(error)
    assert said in text and "\n" not in text and len(text) < 500
    assert_clean_message(text)


def test_markup_in_stored_results_is_shown_as_written(
    pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`llmplan history` prints a table of the user's prompts and plan names: cells are text, not markup."""
    db = tmp_path / "[/dim]results[bold].db"
    stages = [
        {"id": "clean", "uses": "output.postprocess"},
        {"id": "text", "uses": "output.detokenize"},
        {"id": "store", "uses": "output.cache", "with": {"db": str(db)}},
    ]
    plan = plan_for(tmp_path, pristine, extra=stages)
    run_ok(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet", "--prompt", "[bold red]hi[/] :smile:"], capsys)
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "400")  # wide enough that no cell wraps
    with time_bound(30):
        code = main(["history", "--db", str(db)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "[bold red]hi[/] :smile:" in out.out and "😄" not in out.out
    assert "".join(f"results in {db}".split()) in "".join(out.out.split())  # the title wraps to the table
