"""`llmplan`: run, validate, graph, stages, schema — plus commands contributed by plugins.

Every failure a user can cause ends with one line naming the file, position and field, and a
non-zero exit; a traceback appears only with --debug. `llmplan run` exits 0 when every request got
an answer, 3 when the run finished but some request ended with finish_reason `error`, 1 when the
run failed, 130 when it was interrupted, 141 (quietly) when the reader of stdout went away.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmplan.ownership import NotOurs, check_writable, write_file
from llmplan.plain_errors import plain_error

from .cli_help import Parser, add_examples
from .findings import Finding, PlanError
from .memory import mib
from .memory_fit import MemoryPlan, parse_size, plan_memory

if TYPE_CHECKING:  # imported where a command runs: `--help` never builds the plan models (pydantic)
    from .context import Context
    from .executors import Executor
    from .plan import BoundPlan
    from .registry import Registry
    from .yaml_source import Source

COMMAND_GROUP = "llmplan.commands"
REPORTER_GROUP = "llmplan.reporters"
DEFAULT_PLAN = Path(__file__).resolve().parent.parent / "plans" / "llama-int8.yaml"
"""What `run`, `chat` (and `--model PATH`) run with when no plan is given: the plan `make run` runs (int8 weights,
the default prompt and sampling), so a user's model gets the same treatment as the bundled one, in half bf16's
memory."""
DEFAULT_GGUF_PLAN = DEFAULT_PLAN.with_name("llama-stored.yaml")
"""What `--model FILE.gguf` runs with when no plan is given: the default plan with the file's own blocks (mapped,
not converted: no fp32 import on disk, no re-quantization)."""
PLANS_DIR = DEFAULT_PLAN.parent
"""The shipped plans: a PLAN argument that is a bare name (`llama-int8`) is the plan of that name here."""
PLAN_SUFFIXES = (".yaml", ".yml")


def main(argv: list[str] | None = None, *, on_ready: Callable[[], None] | None = None) -> int:
    """`on_ready` is called once the command is parsed, before it runs (engine/entry.py: Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        if getattr(args, "needs_stages", True):
            _registry()  # the stage plugins import torch: before on_ready, inside entry.py's deferred Ctrl-C
        if on_ready is not None:
            on_ready()
        return int(args.handler(args) or 0)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except PlanError as bad:
        for finding in bad.findings:
            _err(str(finding))
        return 1
    except (CliError, NotOurs) as bad:
        _err(str(bad))
        return 1
    except Exception as bug:
        if getattr(args, "debug", False):
            raise
        _err(f"error: {plain_error(bug)}")
        return 1


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout (`| head -1`) went away


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and Python's flush at exit would only print
    another BrokenPipeError (the way Python's docs recommend)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class CliError(Exception):
    """A user-facing error of the command line itself (a bad flag value, a missing file)."""


def _err(text: str) -> None:
    print(text, file=sys.stderr)


# long: one argparse table of the core commands, read top to bottom
def build_parser() -> argparse.ArgumentParser:
    from llmplan import __version__

    parser = Parser(
        prog="llmplan",
        description="Run LLM inference as a declarative plan: a YAML file of typed stages, from checkpoint to text.",
        epilog="example:\n  llmplan run plans/llama-int8.yaml --prompt \"Why is the sky blue?\"\n"
        "  llmplan COMMAND --help     # every command's options, defaults and an example",
    )
    parser.add_argument("-V", "--version", action="version", version=f"llmplan {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run a plan")
    run.add_argument(
        "plan", nargs="?", help=f"a plan file, or a shipped plan's name (llama-int8); none: {DEFAULT_PLAN.stem}"
    )
    _add_plan_options(run)
    add_model_option(run)
    run.add_argument("--until", metavar="STAGE_ID", help="run only this stage and what it depends on")
    run.add_argument("--json", action="store_true", help="machine-readable results on stdout, nothing else")
    run.add_argument(
        "--out",
        metavar="DIR",
        help="the run directory, new or empty (default: <data home>/runs/<time>-<plan>; the data home is "
        "$LLMPLAN_HOME, else ~/.local/share/llmplan)",
    )
    run.add_argument("--quiet", action="store_true", help="no per-stage lines on stderr")
    run.add_argument("--report", action="store_true", help="write the HTML report of the run at the end (it generates)")
    run.add_argument(
        "--replay",
        action="store_true",
        help="answer from the results cache when every request is stored (cache.lookup mode reuse); default: generate",
    )
    scale = run.add_argument_group("executor (the plan's `executor:` block, overridden)")
    scale.add_argument("--executor", choices=["local", "ray"], help="where the requests run")
    scale.add_argument("--address", help="Ray cluster: auto | ray://HOST:PORT | HOST:PORT (default: start one here)")
    scale.add_argument("--replicas", type=int, metavar="N", help="copies of the plan on the cluster")
    scale.add_argument("--threads-per-replica", type=int, metavar="T", help="CPUs (torch threads) per replica")
    scale.add_argument("--gpus-per-replica", type=float, metavar="G", help="GPUs per replica (fractions allowed)")
    run.set_defaults(handler=cmd_run)

    validate = sub.add_parser("validate", help="check plans without loading a model")
    validate.add_argument("plans", nargs="*", help=f"plan files (with --model and none: {DEFAULT_PLAN.name})")
    validate.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE")
    add_model_option(validate)
    validate.add_argument("--deep", action="store_true", help="also check files, hashes and memory fit")
    validate.add_argument(
        "--memory",
        type=_memory_size,
        metavar="BYTES",
        help="--deep: the memory the plan must fit in, e.g. 8G, 512MiB (default: the device's free memory)",
    )
    validate.add_argument("--format", choices=["text", "json"], default="text")
    validate.set_defaults(handler=cmd_validate)

    graph = sub.add_parser("graph", help="draw a plan's stage graph")
    graph.add_argument("plan")
    graph.add_argument("-o", "--output", required=True, help="plan.png | plan.svg | plan.dot | plan.mmd")
    graph.set_defaults(handler=cmd_graph)

    stages = sub.add_parser("stages", help="list registered stages and their parameters, or one stage in full")
    stages.add_argument("name", nargs="?", metavar="NAME", help="one stage (compute.generate): its description in full")
    stages.add_argument("--json", action="store_true")
    stages.set_defaults(handler=cmd_stages)

    schema = sub.add_parser("schema", help="print the JSON Schema of plans")
    schema.set_defaults(handler=cmd_schema)

    for point in entry_points(group=COMMAND_GROUP):
        try:
            point.load()(sub)
        except Exception as bad:  # a broken plugin command must not break the CLI
            _err(f"warning: command plugin {point.name!r} failed to load: {bad}")
    add_examples(sub)
    return parser


def _memory_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE", help="override a parameter")
    parser.add_argument("--prompt", help="one user message (replaces the plan's prompts)")
    parser.add_argument("--prompts", metavar="FILE", help="requests from a JSONL file (or Parquet, same columns)")


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="an HF-format directory (a Hub cache snapshot too) or a .gguf file, in place of the plan's model "
        "source; a directory without SHA256SUMS is hashed on first use and any later change refused",
    )


def settle_plan(args: argparse.Namespace, registry: Registry | None = None) -> None:
    """A command's PLAN and --model, made final: a model given where a plan belongs is refused with the way to
    say it; --model with no plan means the default plan; --model becomes overrides of the plan's source stage
    (appended to args.set, so the plan file itself is never edited)."""
    plan = getattr(args, "plan", None)
    model = getattr(args, "model", None)
    if plan is not None:
        refuse_model_as_plan(plan, args.command)
        args.plan = plan = plan_path(plan)
    if model is not None and not os.path.lexists(model):
        raise CliError(f"--model {model}: not found (an HF-format directory or a .gguf file)")
    if plan is None:
        args.plan = plan = default_plan(model)
        if model is None:  # Ollama's `run MODEL` habit: no plan is the default one, said once
            _err(f"{args.command}: no plan given, so the default plan {plan_label(plan)} ({plan})")
    if model is not None:
        args.set = [*(getattr(args, "set", None) or []), *model_overrides(model, registry or _registry(), plan)]


def default_plan(model: str | None = None) -> str:
    """The plan run when none is given: for a .gguf model the one that keeps its blocks, else DEFAULT_PLAN."""
    plan = DEFAULT_GGUF_PLAN if model is not None and model.lower().endswith(".gguf") else DEFAULT_PLAN
    if not plan.is_file():
        raise CliError(f"no plan given and the default plan {plan} is not there: give a plan file")
    return str(plan)


def shipped_plans() -> list[str]:
    """The names of the shipped plans (the plans folder's YAML files, without the suffix)."""
    try:
        return sorted(p.stem for p in PLANS_DIR.iterdir() if p.suffix in PLAN_SUFFIXES and p.is_file())
    except OSError:
        return []


def plan_label(plan: str) -> str:
    """A plan file as its name when it is a shipped one (what `llmplan run NAME` takes), else as given."""
    path = Path(plan)
    return path.stem if path.parent.resolve() == PLANS_DIR.resolve() else plan


def plan_path(plan: str) -> str:
    """A PLAN argument as a file: a path as it is; a bare name (no folder, e.g. `llama-int8`) that is no file here
    is the shipped plan of that name, from any directory; an unknown name is one line listing the known ones."""
    if os.path.lexists(plan) or Path(plan).name != plan or plan in (".", ".."):
        return plan  # a path: the loader says what is wrong with it, at file:line:column
    for name in (plan, *(plan + suffix for suffix in PLAN_SUFFIXES)):
        if (PLANS_DIR / name).is_file():
            return str(PLANS_DIR / name)
    if Path(plan).suffix in PLAN_SUFFIXES:
        return plan  # a file name: "file not found" names it
    from .messages import suggest

    known = shipped_plans()
    raise CliError(
        f"{plan}: no plan file and no shipped plan of that name{suggest(plan, known)}; "
        f"known: {', '.join(known) or '(none: the plans folder is missing)'}"
    )


def refuse_model_as_plan(plan: str, command: str) -> None:
    """`llmplan run DIR` (or a .gguf): a model where the plan belongs. Say how to run it instead."""
    path = Path(plan)
    if path.is_dir() or (path.suffix.lower() == ".gguf" and path.is_file()):
        raise CliError(
            f"{plan}: a model, not a plan file; run it with `llmplan {command} --model {plan}` "
            f"(the default plan) or `llmplan {command} PLAN --model {plan}`"
        )


def model_overrides(model: str, registry: Registry, plan: str) -> list[str]:
    """`--model PATH` as overrides of every stage of the plan whose plugin is a model source."""
    try:
        from .yaml_source import load_file

        source = load_file(plan)
    except PlanError:
        return []  # loading the plan again reports it, with its position
    stages = source.data.get("stages") if isinstance(source.data, dict) else None
    overrides: list[str] = []
    for spec in stages if isinstance(stages, list) else []:
        uses, stage_id = (spec.get("uses"), spec.get("id")) if isinstance(spec, dict) else (None, None)
        stage_cls = registry.get(uses) if isinstance(uses, str) else None
        params = stage_cls.model_params(model) if stage_cls is not None else None
        if params is None or not isinstance(stage_id, str):
            continue
        overrides += [f"{stage_id}.{name}={json.dumps(value, ensure_ascii=False)}" for name, value in params.items()]
    if not overrides:
        raise CliError(f"--model: no stage of {plan} is a model source (see `llmplan stages`)")
    return overrides


def plan_overrides(args: argparse.Namespace, registry: Registry, source: Source) -> list[str]:
    """`--set` overrides, then --prompt / --prompts as overrides of the stages whose plugin takes prompts."""
    overrides = list(getattr(args, "set", []) or [])
    # The executor flags are overrides of the plan's `executor:` block, validated (and reported) like --set.
    for flag, key in EXECUTOR_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"executor.{key}={json.dumps(value)}")
    message, prompts_file = getattr(args, "prompt", None), getattr(args, "prompts", None) or None
    if message is None and prompts_file is None:
        return overrides
    stages = source.data.get("stages") if isinstance(source.data, dict) else None
    takers = 0
    for spec in stages if isinstance(stages, list) else []:
        uses, stage_id = (spec.get("uses"), spec.get("id")) if isinstance(spec, dict) else (None, None)
        stage_cls = registry.get(uses) if isinstance(uses, str) else None
        params = stage_cls.prompt_params(message, prompts_file) if stage_cls is not None else None
        if params is None or not isinstance(stage_id, str):
            continue
        takers += 1
        overrides += [f"{stage_id}.{name}={json.dumps(value, ensure_ascii=False)}" for name, value in params.items()]
    if not takers:
        flag = "--prompt" if message is not None else "--prompts"
        raise CliError(f"{flag}: no stage of {source.file} takes prompts (see `llmplan stages`)")
    return overrides


EXECUTOR_FLAGS = {
    "executor": "kind",
    "address": "address",
    "replicas": "replicas",
    "threads_per_replica": "threads_per_replica",
    "gpus_per_replica": "gpus_per_replica",
}


# --- run -----------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from .console import RichProgress, print_stage, stderr
    from .runner import Runner

    registry = _registry()
    settle_plan(args, registry)
    from .plan import bind
    from .yaml_source import load_file

    source = load_file(args.plan)
    overrides = plan_overrides(args, registry, source)
    bound = bind(source, registry, overrides)
    executor = _executor(bound.plan.executor.kind)  # first: a missing package makes no run and says only that
    extra = lookup_overrides(bound, registry, args.plan, replay=args.replay, report=args.report)
    extra += seed_overrides(bound, source, overrides, quiet=args.quiet or args.json)
    if extra:  # what the run itself decides, validated and recorded like the user's --set
        overrides = [*overrides, *extra]
        bound = bind(source, registry, overrides)
    if args.report:
        bound, overrides = _observe_for_report(source, registry, bound, overrides)
    if args.until is not None and bound.plan.executor.kind != "local":
        kind = bound.plan.executor.kind
        raise CliError(f"--until runs part of the plan in this process; it does not go with executor {kind!r}")
    if args.until is not None and args.until not in {b.id for b in bound.stages}:
        raise CliError(f"--until: no stage with id {args.until!r} in {args.plan}")
    run_dir = _run_dir(args.out, bound)
    if executor is not None:
        return _run_elsewhere(executor, args, bound, registry, run_dir, overrides)
    ctx = new_context(registry, bound, json_mode=args.json)
    ctx.progress = RichProgress(enabled=not args.quiet)
    if not args.json:
        ctx.stream = _stdout_stream
    reporter = None if args.quiet else print_stage
    result = Runner(bound, ctx, run_dir, until=args.until, report=reporter, debug=args.debug).run()
    if ctx.notices:  # each was printed when it happened; the count, once more, where it is seen
        kinds = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in ctx.notice_summary()["by_kind"].items())
        _err(f"inputs dropped or changed: {kinds} (listed in metrics.json)")
    if not args.quiet:
        stderr.print(f"run directory: {result.run_dir}", style="dim")
    if args.report:
        page = write_report(result.run_dir)
        stderr.print(f"report: {page}" if page else "report: no reporter plugin is installed", style="yellow")
    if result.exit_code == EXIT_BROKEN_PIPE:  # a reader that stopped reading wants no message
        _silence_stdout()
    elif result.status == "interrupted":
        _err("interrupted")  # the same one line as every other phase (engine/entry.py)
    elif result.exit_code:
        _err(f"error: {result.message}")
    return result.exit_code


def lookup_overrides(bound: BoundPlan, registry: Registry, plan: str, *, replay: bool, report: bool) -> list[str]:
    """A run generates unless a replay is asked for: `--replay` turns the plan's replaying stages (a stage class's
    `replay_setting`) to replay; `--report` needs a run that generates (a replay has no timings or attention to
    draw), so it sets a plan's replay aside for this run, in one line."""
    lookups = [(b, b.cls.replay_setting) for b in bound.stages if b.cls.replay_setting]
    if replay and report:
        raise CliError("--replay and --report: a report draws a run that generates; give one of them")
    if replay:
        if not lookups:
            kinds = [n for n in registry.names() if getattr(registry.get(n), "replay_setting", None)]
            raise CliError(f"--replay: {plan} has no {' or '.join(kinds) or 'replaying'} stage to replay from")
        return [f"{b.id}.{name}={on}" for b, (name, on, _) in lookups]
    reusing = [(b, (name, on, off)) for b, (name, on, off) in lookups if getattr(b.params, name) == on]
    if report and reusing:
        said = ", ".join(f"{b.id}.{name} {on}" for b, (name, on, _) in reusing)
        _err(f"report: this run generates ({said} set aside for it)")
        return [f"{b.id}.{name}={off}" for b, (name, _, off) in reusing]
    return []


def seed_overrides(
    bound: BoundPlan, source: Source, overrides: list[str], *, quiet: bool, what: str = "run"
) -> list[str]:
    """A sampled plan that pins no seed samples anew each run (as Ollama and vLLM do), or each chat session
    (`what`): a fresh seed, recorded in the run's plan.resolved.yaml and said in one line, so `--set seed=N`
    repeats the run. A plan's own `seed:` (or a --set, or the generate stage's seed) pins it: that run is
    reproducible and its answers replayable."""
    data = source.data if isinstance(source.data, dict) else {}
    if "seed" in data or any(o.split("=", 1)[0].strip() == "seed" for o in overrides):
        return []
    if not any(b.cls.draws_from_seed(b.params) for b in bound.stages):
        return []
    import secrets

    seed = secrets.randbelow(1 << 31)
    if not quiet:
        _err(f"seed {seed}: drawn for this {what} (the plan pins none; --set seed={seed} repeats it)")
    return [f"seed={seed}"]


def _run_dir(out: str | None, bound: BoundPlan) -> Path:
    """--out DIR: new, empty, or a run directory holding only files llmplan wrote (checked before anything is
    written or loaded: a run never replaces a file of the user's); without --out a fresh one under runs_dir."""
    from .runner import check_run_dir, make_run_dir

    if not out:
        try:
            return make_run_dir(bound.plan.runs_dir, bound.plan.name)
        except OSError as bad:
            where = bound.plan.runs_dir
            raise CliError(f"runs_dir {where}: cannot create a run directory there ({bad.strerror or bad})") from None
    run_dir = Path(out)
    if run_dir.is_dir():
        check_run_dir(run_dir, "--out")  # a file of the user's in it is named first
        refuse_earlier_run(run_dir)
        return run_dir
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        raise CliError(f"--out {run_dir}: exists and is not a directory") from None
    except OSError as bad:
        raise CliError(f"--out {run_dir}: cannot create the run directory ({bad.strerror or bad})") from None
    return run_dir


def refuse_earlier_run(run_dir: Path) -> None:
    """`--out DIR` is the run directory itself, so it must be new or empty: a second run there would replace the
    first one's files while the results database still points at them (transformers' scripts refuse a non-empty
    output_dir the same way; a fresh sub-directory would move the files a script expects at DIR)."""
    entries = sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("."))
    if entries:
        what = "an earlier run" if {"plan.resolved.yaml", "stages.json"} & set(entries) else f"{entries[0]}, …"
        raise CliError(f"--out {run_dir}: holds {what}; a run never replaces another: give a new or empty directory")


def _executor(kind: str) -> Executor | None:
    """The executor plugin of `kind`, checked ready to run (None for local, the Runner here)."""
    from .executors import ExecutorMissing, find_executor

    if kind == "local":
        return None
    try:
        executor = find_executor(kind)
        executor.check()
    except ExecutorMissing as missing:
        raise CliError(str(missing)) from None
    return executor


def _run_elsewhere(
    executor: Executor,
    args: argparse.Namespace,
    bound: BoundPlan,
    registry: Registry,
    run_dir: Path,
    overrides: list[str],
) -> int:
    """Hand the run to the executor plugin the plan names (`executor.kind`); it reports its own progress."""
    from .executors import ExecutorJob

    job = ExecutorJob(bound, registry, run_dir, overrides, json_mode=args.json, quiet=args.quiet, debug=args.debug)
    code = executor(job)
    if args.report:
        page = write_report(run_dir)
        _err(f"report: {page}" if page else "report: no reporter plugin is installed")
    return code


def _observe_for_report(
    source: Source, registry: Registry, bound: BoundPlan, overrides: list[str]
) -> tuple[BoundPlan, list[str]]:
    """`run --report`: turn on, for this run only, what the reporter's pictures need and the plan does not
    observe (a plan's `observe:` costs time, so runs without a report never pay for it); said in one line."""
    wanted = {
        key: (value, label)
        for key, (value, label) in report_observes().items()
        if not getattr(bound.plan.observe, key, None) and not any(o.startswith(f"observe.{key}=") for o in overrides)
    }  # what the plan or the user's own --set already decided stays theirs
    if not wanted:
        return bound, overrides
    added = [f"observe.{key}={json.dumps(value)}" for key, (value, _) in wanted.items()]
    labels = " and ".join(label for _, label in wanted.values())
    _err(f"report: this run also records {labels} for its pictures ({', '.join(a.split('=')[0] for a in added)})")
    overrides = [*added, *overrides]
    from .plan import bind

    return bind(source, registry, overrides), overrides


def report_observes() -> dict[str, tuple[Any, str]]:
    """What the installed reporter plugin's pictures need observed: its module's REPORT_OBSERVES, {observe key:
    (value, what it records)}; loading it is cheap (the pictures' imports wait for a report to be drawn)."""
    for point in entry_points(group=REPORTER_GROUP):
        point.load()
        return dict(getattr(sys.modules[point.module], "REPORT_OBSERVES", {}))
    return {}


def write_report(run_dir: Path) -> Path | None:
    """Ask the installed reporter plugin (entry-point group `llmplan.reporters`) for the run's report."""
    for point in entry_points(group=REPORTER_GROUP):
        return Path(point.load()(run_dir))
    return None


def _stdout_stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def new_context(registry: Registry, bound: BoundPlan, *, json_mode: bool = False) -> Context:
    ctx = registry.context_cls()
    ctx.plan = bound
    ctx.json_mode = json_mode
    return ctx


def _registry() -> Registry:
    # Broken plugins are reported where they matter: by `stages`, and as a finding when a plan uses one.
    from .registry import discover

    return discover()


# --- validate ------------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    registry = _registry()
    findings: list[Finding] = []
    estimates: dict[str, dict[str, int]] = {}
    memory: dict[str, MemoryPlan] = {}
    if args.memory is not None and not args.deep:
        raise CliError("validate: --memory needs --deep (the memory plan reads the model's files)")
    if args.model is not None and not os.path.lexists(args.model):
        raise CliError(f"--model {args.model}: not found (an HF-format directory or a .gguf file)")
    if not args.plans:
        if args.model is None:
            raise CliError("validate: give plan files, or --model PATH")
        args.plans = [default_plan(args.model)]
    for named in args.plans:
        refuse_model_as_plan(named, "validate")
        path = plan_path(named)
        overrides = [*args.set, *(model_overrides(args.model, registry, path) if args.model else [])]
        try:
            from .plan import load_plan

            bound = load_plan(path, registry, overrides)
        except PlanError as bad:
            findings += bad.findings
            continue
        except RecursionError:  # one pathological file must not hide the findings of the others
            findings.append(Finding(path, 1, 1, "", "nesting too deep to check; refused"))
            continue
        if args.deep:
            problems, estimate, planned = deep_memory_check(bound, args.memory)
            findings += problems
            estimates[path] = estimate
            if planned is not None:
                memory[path] = planned
    if args.format == "json":
        out = {"ok": not findings, "findings": [f.to_dict() for f in findings], "estimates": estimates}
        print(json.dumps(out | {"memory": {path: plan.to_dict() for path, plan in memory.items()}}))
    else:
        for finding in findings:
            print(str(finding))
        for path, estimate in estimates.items():
            if estimate:
                print(f"{path}: memory estimate: {estimate_line(estimate, memory.get(path))}", file=sys.stderr)
        over = [path for path, planned in memory.items() if not planned.fits]
        if not findings and not over:  # "ok" only where nothing was found and every prediction fits
            fits = ", each within its memory" if memory else ""
            print(f"ok: {len(args.plans)} plan(s) valid{fits}", file=sys.stderr)
    return 1 if findings else 0


def estimate_line(estimate: dict[str, int], planned: MemoryPlan | None) -> str:
    """The regions, and the predicted peak against the memory there is; one over it says so plainly."""
    parts = ", ".join(f"{k} {mib(v)}" for k, v in estimate.items() if k != "available")
    if planned is None:
        return parts
    peaks = "".join(f", peak while {k} {mib(v)}" for k, v in planned.peaks.items())
    if planned.file_backed:  # mapped pages: shared with other processes, evictable, not this process's own
        parts += f" (file-backed {mib(sum(planned.file_backed.values()))}, anonymous {mib(planned.anonymous)})"
    peaks += "".join(f"; writes {k} of {mib(v)} to disk" for k, v in planned.disk.items())
    where = f"{mib(planned.available)} ({planned.available_from})"
    if planned.fits:
        return f"{parts}{peaks}; predicted peak {mib(planned.peak)} of {where}"
    return f"{parts}{peaks}; predicted peak {mib(planned.peak)}, over the {where}: it does not fit"


def deep_check(bound: BoundPlan) -> tuple[list[Finding], dict[str, int]]:
    findings, estimates, _ = deep_memory_check(bound)
    return findings, estimates


def deep_memory_check(
    bound: BoundPlan, memory: int | None = None, facts: dict[str, Any] | None = None
) -> tuple[list[Finding], dict[str, int], MemoryPlan | None]:
    """The stages' deep checks, and the memory plan against `memory` bytes (default: the device's free memory).
    `facts`, when given, receives what the stages learnt (another plan's check reads its config there)."""
    from .stage import DeepCheck

    deep = DeepCheck(bound)
    for stage in bound.stages:
        deep.current = stage.id
        try:
            stage.cls().check(stage.params, deep)
        except Exception as bad:
            deep.problem(f"check failed: {plain_error(bad)}")
    if facts is not None:
        facts.update(deep.facts)
    capacity = ("--memory", memory) if memory is not None else deep.capacity
    planned = None
    if capacity is not None and deep.estimates:
        sizing = deep.facts.get("kv_sizing")
        planned = plan_memory(deep.estimates, deep.peaks, capacity, sizing)
        planned.file_backed, planned.disk = dict(deep.file_backed), dict(deep.disk)
        if not planned.fits:  # one line per plan, on the KV cache's stage when the KV cache is what to change
            moment = planned.transient()
            deep.current = deep.peak_stages.get(moment or "") or planned.kv_stage or bound.stages[0].id
            field = "kv_cache.max_tokens" if planned.max_tokens is not None else ""
            deep.problem(planned.verdict(), field)
    findings = []
    index = {b.id: b.index for b in bound.stages}
    for stage_id, field, message in deep.problems:
        path: tuple[Any, ...] = ("stages", index.get(stage_id, 0), "with", *[p for p in field.split(".") if p])
        if not field:
            path = ("stages", index.get(stage_id, 0), "uses")
        findings.append(bound.source.finding(path, message))
    return findings, deep.estimates, planned


# --- graph, stages, schema -----------------------------------------------------------------------


def cmd_graph(args: argparse.Namespace) -> int:
    from .drawing import draw_graph
    from .graph import to_dot, to_mermaid
    from .plan import load_plan

    bound = load_plan(plan_path(args.plan), _registry())
    out = Path(args.output)
    suffix = out.suffix.lower()
    if suffix not in (".dot", ".mmd", ".mermaid", ".png", ".svg"):
        raise CliError(f"-o {out}: unknown format {suffix!r} (use .png, .svg, .dot or .mmd)")
    check_writable(out, "file", "-o")  # before drawing: a file of the user's is never replaced
    try:
        if suffix == ".dot":
            write_file(out, to_dot(bound.graph), "-o")
        elif suffix in (".mmd", ".mermaid"):
            write_file(out, to_mermaid(bound.graph), "-o")
        else:
            draw_graph(bound.graph.dag, out, title=f"plan {bound.plan.name}")
    except OSError as bad:
        raise CliError(f"-o {out}: cannot write ({bad.strerror or bad})") from None
    print(out)
    return 0


def cmd_stages(args: argparse.Namespace) -> int:
    from .messages import suggest
    from .stage_docs import describe_stage, option_lines

    registry = _registry()
    names = registry.names()
    if args.name is not None and args.name not in names:
        raise CliError(f"no stage {args.name!r}{suggest(args.name, names)}; `llmplan stages` lists them all")
    rows = [describe_stage(name, registry) for name in ([args.name] if args.name else names)]
    if args.json:
        print(json.dumps(rows[0] if args.name else rows, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, markup=False, emoji=False)  # plugin names and docs are shown as written

    def say(line: str) -> None:  # wrapped to the terminal, continued under its own text
        hang = " " * (len(line) - len(line.lstrip(" •")) + 2)
        console.print(textwrap.fill(line, max(console.width, 40), subsequent_indent=hang, break_on_hyphens=False))

    if args.name is None:
        for name, why in registry.broken.items():
            console.print(f"{name}: failed to load: {why}", style="red")
    for row in rows:
        doc = row["description"] if args.name else row["doc"]
        console.print(Text.assemble((row["name"], "bold"), "  ", (f"({row['phase']})", "dim")))
        for paragraph in doc.split("\n\n"):  # the description's own paragraphs, rewrapped to the terminal
            say("    " + " ".join(paragraph.split()))
        flow = f"reads {', '.join(row['reads']) or '-'}  →  writes {', '.join(row['writes']) or '-'}"
        if row["fills"]:
            flow += f"  (may fill {', '.join(row['fills'])})"
        if row["edits"]:
            flow += f"  (edits {', '.join(row['edits'])} before any other reader)"
        say(f"    {flow}{'  [always runs]' if row['always'] else ''}")
        if args.name:
            say("    options, under the stage's `with:`:" if row["params"] else "    no options")
        for line in option_lines(row["params"]):
            say(line)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from .schema import plan_schema

    print(json.dumps(plan_schema(_registry()), indent=2))
    return 0

