"""What a person sees on the terminal: progress bars and a line per stage, all on stderr.

stdout is kept for results (streamed text, or JSON lines with --json), so piping `llmplan run`
never mixes progress into the data. Nothing printed here is read as rich markup or emoji codes: a
path, plan name or prompt holding `[/dim]` or `:smile:` is shown as written; styles are given as
`style=` or `Text` spans, never inside the text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from .context import Progress as ProgressHook
from .memory import mib
from .runner import StageRecord

stderr = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


class RichProgress(ProgressHook):
    """Transient rich progress bars for long work inside a stage (hashing, reading shards)."""

    def __init__(self, console: Console = stderr, enabled: bool = True) -> None:
        self.console = console
        self.quiet = not enabled  # --quiet: no bars, nor the plain lines that stand in for them off a terminal
        self.enabled = enabled and console.is_terminal

    @contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Callable[[float], None]]:
        if not self.enabled:
            yield lambda _advance: None
            return
        columns = [TextColumn("  {task.description}", markup=False), BarColumn()]
        if total and total > 1 << 20:
            columns.append(DownloadColumn())
        elif total:
            columns.append(MofNCompleteColumn())  # a count (requests done / total), not bytes
        columns.append(TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda advance: bar.advance(task, advance)


def stage_line(record: StageRecord) -> Text:
    if record.status == "skipped":
        return Text(f"- {record.id:<12} {record.uses:<22} skipped ({record.reason})", style="dim")
    mark = Text("✓", style="green") if record.status == "ok" else Text("✗", style="red")
    delta = record.rss_after - record.rss_before
    sign = "+" if delta >= 0 else "-"
    text = f" {record.id:<12} {record.uses:<22} {record.wall_s:8.3f} s   RSS {sign}{mib(abs(delta))}"
    if record.device_after is not None and record.device_before is not None:
        text += f"   device {mib(record.device_after)}"
    return Text.assemble(mark, text)


def print_stage(record: StageRecord, console: Console = stderr) -> None:
    console.print(stage_line(record))
