"""The command line: exit codes, one-line errors, JSON findings, graph pictures, stage listing, schema."""

from __future__ import annotations

import json
import subprocess
import sys

from llmplan.engine.cli import main

GOOD = """\
name: toy
stages:
  - {id: numbers, uses: toy.numbers, with: {count: 3}}
  - {id: square, uses: toy.square}
  - {id: total, uses: toy.total}
  - {id: cleanup, uses: toy.cleanup}
"""


def test_validate_ok_and_bad(write_plan, toy_plugin, capsys):
    good = write_plan(GOOD, "good.yaml")
    assert main(["validate", str(good)]) == 0
    bad = write_plan(GOOD.replace("count: 3", "count: 0"), "bad.yaml")
    assert main(["validate", str(good), str(bad)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{bad}:3:52: stages[0].with.count: must be >= 1 (got 0)"]


def test_validate_json_findings(write_plan, toy_plugin, capsys):
    bad = write_plan(GOOD.replace("toy.square", "toy.squares"), "bad.yaml")
    assert main(["validate", "--format", "json", str(bad)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    (finding,) = report["findings"]
    assert (finding["line"], finding["column"], finding["field"]) == (4, 24, "stages[1].uses")
    assert finding["message"].startswith("unknown stage 'toy.squares' (did you mean 'toy.square'?)")


def test_run_with_set_and_until(write_plan, toy_plugin, tmp_path, capsys):
    plan = write_plan(GOOD)
    code = main(["run", str(plan), "--set", "numbers.count=5", "--out", str(tmp_path / "r"), "--quiet"])
    assert code == 0
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics["total"]["total"] == 1 + 4 + 9 + 16 + 25
    code = main(["run", str(plan), "--until", "nope", "--out", str(tmp_path / "r2"), "--quiet"])
    assert code == 1
    assert capsys.readouterr().err.strip().endswith("--until: no stage with id 'nope' in " + str(plan))


def test_run_failure_is_one_line_without_traceback(write_plan, toy_plugin, tmp_path, capsys):
    plan = write_plan(GOOD.replace("toy.square}", "toy.crash}"))
    assert main(["run", str(plan), "--out", str(tmp_path / "r"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: stage 'square' (toy.crash): failed unexpectedly (division by zero); run with --debug for the traceback"
    ]


def test_graph_outputs(write_plan, toy_plugin, tmp_path):
    plan = write_plan(GOOD)
    assert main(["graph", str(plan), "-o", str(tmp_path / "g.dot")]) == 0
    dot = (tmp_path / "g.dot").read_text()
    assert '"numbers" -> "square" [label="ext.numbers"' in dot
    assert main(["graph", str(plan), "-o", str(tmp_path / "g.mmd")]) == 0
    assert (tmp_path / "g.mmd").read_text().startswith("flowchart LR")
    assert main(["graph", str(plan), "-o", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stages_lists_third_party_plugin_with_params(toy_plugin, capsys):
    assert main(["stages", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    numbers = rows["toy.numbers"]
    assert numbers["module"] == "toy_stages"
    assert numbers["writes"] == ["ext.numbers"]
    count = next(p for p in numbers["params"] if p["name"] == "count")
    assert count == {
        "name": "count",
        "type": "1 <= int <= 1000",
        "required": False,
        "default": 3,
        "doc": "how many numbers",
        "options": [],
    }


def test_stages_reads_as_a_plan_is_written(capsys, monkeypatch):
    """#29: readable types (no annotation reprs), defaults as YAML/JSON writes them, nested options beneath."""
    monkeypatch.setenv("COLUMNS", "250")  # one line per option
    assert main(["stages"]) == 0
    listing = capsys.readouterr().out
    for leak in ("Annotated", "StringConstraints", "FieldInfo", "typing.", "metadata="):
        assert leak not in listing, leak
    assert main(["stages", "compute.generate"]) == 0
    one = capsys.readouterr().out.splitlines()
    assert one[0].split() == ["compute.generate", "(compute)"]
    assert "    • stop: list[str] = []  — stop strings (on decoded text)" in one
    assert any(line.startswith("    • max_new_tokens: (1 <= int <= 1048576) | null = null  — ") for line in one)  # #57
    assert any(line.startswith('    • early_stopping: bool | "never" = false') for line in one)
    assert any(line.startswith("    • seed: (int >= 0) | null = null") for line in one)
    spec = next(i for i, line in enumerate(one) if line.startswith("    • speculative: Speculation | null = null"))
    assert one[spec + 2].startswith("        • tokens: 1 <= int <= 16 = 4  — ")  # its own options, indented
    assert main(["stages", "compute.generate", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["name"] == "compute.generate" and row["description"].startswith("Prefill and decode")
    nested = next(p for p in row["params"] if p["name"] == "speculative")["options"]
    assert [o["name"] for o in nested] == ["method", "tokens", "ngram"]


def test_stages_of_an_unknown_name_is_one_line(capsys):
    assert main(["stages", "compute.generat"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["no stage 'compute.generat' (did you mean 'compute.generate'?); `llmplan stages` lists them all"]


def test_schema_types_each_stage_params(toy_plugin, capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    text = json.dumps(schema)
    assert "Stage_toy_numbers" in text and '"maximum": 1000' in text
    assert schema["required"] == ["name", "stages"]


def test_cli_entry_point_exit_code_and_stderr(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("name: [\n")
    proc = subprocess.run(
        [sys.executable, "-m", "llmplan", "validate", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert proc.stdout.strip().startswith(f"{bad}:2:1: YAML syntax error")
    assert "Traceback" not in proc.stdout + proc.stderr


def test_ctrl_c_from_outside_runs_cleanup_and_exits_130(tmp_path):
    import os
    import signal
    import time

    from .conftest import TOY

    plan = tmp_path / "plan.yaml"
    ready, marker = tmp_path / "ready", tmp_path / "cleaned"
    plan.write_text(
        GOOD.replace("uses: toy.square}", f"uses: toy.sleep, with: {{ready: '{ready}'}}}}").replace(
            "uses: toy.cleanup}", f"uses: toy.cleanup, with: {{marker: '{marker}'}}}}"
        )
    )
    env = {**os.environ, "PYTHONPATH": f"{TOY}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmplan", "run", str(plan), "--out", str(tmp_path / "run")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert marker.read_text() == "cleaned"
    assert err.strip().splitlines()[-1] == "interrupted"  # the same one line in every phase (issue 11)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["message"] == "stage 'square' (toy.sleep): interrupted (Ctrl-C); ran the cleanup stages"
    assert "Traceback" not in err
    statuses = {s["id"]: s["status"] for s in json.loads((tmp_path / "run" / "stages.json").read_text())}
    assert statuses == {"numbers": "ok", "square": "failed", "total": "not_run", "cleanup": "ok"}
