"""`llmplan chat PLAN`: a conversation in the terminal with the model loaded once.

    llmplan chat plans/llama-int8.yaml [--system TEXT] [--set ID.PARAM=VALUE ...]

Each turn sends the whole history through the chat template (the plan's tokenize stage) and streams the
answer as it comes, word-wrapped to the terminal's width (chat_wrap.py). Lines are edited with history on a
terminal, and a \"\"\" block is one message over several lines (chat_input.py); the /commands and their help
are one table (chat_commands.py). Ctrl-C stops the current answer, not the program. Every turn runs the
plan's request stages, so a plan with an `output.cache` stage stores the conversation in its results
database, turn by turn.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from llmplan.engine.cli import CliError, add_model_option, seed_overrides, settle_plan
from llmplan.engine.findings import StageFailure

from ..serve.command import build_host

if TYPE_CHECKING:  # the model host loads when a chat starts, not for `--help`
    from ..serve.host import ModelHost

BANNER = '/help lists the commands, """ begins a message over several lines, Ctrl-D ends'


def register(subparsers: Any) -> None:
    chat = subparsers.add_parser("chat", help="talk with the plan's model in the terminal")
    chat.add_argument("plan", nargs="?", help="the plan (with --model and no plan: the default plan)")
    chat.add_argument("--system", help="a system prompt for the conversation")
    chat.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE", help="override a parameter")
    add_model_option(chat)
    chat.set_defaults(handler=cmd_chat)


class Conversation:
    """The history and the per-conversation settings; one turn at a time through a ModelHost."""

    def __init__(
        self, host: ModelHost, system: str | None, out: TextIO, width: Callable[[], int | None] = lambda: None
    ) -> None:
        self.host, self.system, self.out, self.width = host, system, out, width
        self.history: list[dict[str, str]] = []
        self.settings: dict[str, Any] = {}
        self.notes: list[str] = []  # more lines for /help (where the input history is kept)

    def messages(self, user: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history, {"role": "user", "content": user}]

    def turn(self, user: str) -> None:
        """Stream one answer; Ctrl-C cancels it (what was shown stays in the history)."""
        tokenize: dict[str, Any] = {"messages": self.messages(user), "text": None, "prompts_file": None}
        if self.system:
            tokenize["system"] = None  # ours is already the first message
        overrides = {self.host.tokenize_id: tokenize, self.host.generate_id: {**self.settings, "stream": True}}
        from .wrap import WordWrap

        shown: list[str] = []
        cancel = threading.Event()
        outcome: dict[str, Any] = {}
        wrap = WordWrap(self.out, self.width())

        def show(piece: str) -> None:
            shown.append(piece)
            wrap.write(piece)

        def work() -> None:
            try:
                outcome["run"] = self.host.run(overrides, stream=show, cancel=cancel)  # type: ignore[arg-type]
            except BaseException as bad:  # handed to the main thread, which reports it
                outcome["error"] = bad

        # During the answer Ctrl-C only sets `cancel` (a KeyboardInterrupt could land anywhere, even after the
        # answer ended); the scheduler then ends the request at its next step.
        previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.set())
        worker = threading.Thread(target=work, daemon=True)
        try:
            worker.start()
            while worker.is_alive():  # this (main) thread is the model thread: it steps the answer
                self.host.pump(0.01)
        finally:
            signal.signal(signal.SIGINT, previous)
        if cancel.is_set():
            wrap.write(" [stopped]")
        from llmplan.engine.serving import RequestError

        from ..serve.host import RequestFailed

        error = outcome.get("error")
        if isinstance(error, RequestError | RequestFailed | StageFailure):
            wrap.end()
            self.out.write(f"\nerror: {error}\n")
            return
        if error is not None:
            raise error
        text = "".join(shown)
        run = outcome.get("run")
        if run is not None and run.context.completions:
            final = run.context.completions[0].text
            if final.startswith(text):  # what the stream had not shown yet (an incomplete last character)
                wrap.write(final[len(text) :])
                text = final
        wrap.end()
        self.out.write("\n")
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]

    def command(self, line: str) -> bool:
        """Run a /command; False when the conversation should end."""
        from .slash_commands import run_command

        return run_command(self, line)

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def cmd_chat(args: argparse.Namespace) -> int:
    from .input_lines import history_path, interactive, make_reader

    settle_plan(args)
    host = build_host(args.plan, [*args.set, *session_seed(args.plan, args.set)], keep_alive_s=None, quiet=False)
    try:
        try:
            host.load()
        except StageFailure as bad:
            raise CliError(f"loading {args.plan} failed: {bad}") from None
        if host.plan.stage_by_use("output.cache") is None:
            print("note: this plan has no output.cache stage; the conversation is not stored", file=sys.stderr)
        conversation = Conversation(host, args.system, sys.stdout, terminal_width)
        reader = make_reader(lambda note: print(note, file=sys.stderr))
        if interactive():
            conversation.notes.append(f"Up/Down and Ctrl-R: earlier messages (kept in {history_path()})")
        conversation.say(f"chatting with {host.bound.plan.name} ({BANNER})")
        talk(conversation, reader.read)
    finally:
        host.close()
    return 0


def session_seed(plan: str, overrides: list[str]) -> list[str]:
    """A sampled plan that pins no seed gets a fresh one for this session, said in one line (as `run` does):
    a new chat samples anew, and `--set seed=N` repeats one."""
    from llmplan.engine.plan import bind
    from llmplan.engine.registry import discover
    from llmplan.engine.yaml_source import load_file

    source = load_file(plan)
    return seed_overrides(bind(source, discover(), overrides), source, overrides, quiet=False, what="session")


def talk(conversation: Conversation, read: Callable[[], str]) -> None:
    """Read a message, answer it, until /exit or the end of the input."""
    while True:
        try:
            line = read()
            if not line:
                continue
            if not readable(conversation, line):
                continue
            if line.startswith("/"):
                if not conversation.command(line):
                    break
                continue
            conversation.turn(line)
        except EOFError:
            break
        except KeyboardInterrupt:  # at the prompt (or between answers): drop the line, as a shell does
            print()


def readable(conversation: Conversation, line: str) -> bool:
    """A line whose bytes were not UTF-8 (kept as surrogates by the reader) is refused in one line, not sent:
    neither the tokenizer nor a file name of /save could take it, and the chat goes on."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as bad:
        code = ord(line[bad.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"  # surrogateescape's
        conversation.say(f"error: the line is not UTF-8 text ({what} at character {bad.start}); not sent")
        return False
    return True


def terminal_width() -> int | None:
    """The columns to wrap answers at: the terminal's, asked at each turn (it may have been resized)."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None
