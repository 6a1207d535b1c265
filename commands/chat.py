"""`llmplan chat PLAN`: a conversation in the terminal with the model loaded once.

    llmplan chat plans/llama-int8.yaml [--system TEXT] [--set ID.PARAM=VALUE ...]

Each turn sends the whole history through the chat template (the plan's tokenize stage) and streams the
answer as it comes. Commands: /reset, /save FILE, /set NAME VALUE (a generate parameter, e.g. /set
temperature 0.2), /system TEXT, /help, /exit (or Ctrl-D). Ctrl-C stops the current answer, not the program.
Every turn runs the plan's request stages, so a plan with an `output.cache` stage stores the conversation
in its results database, turn by turn.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

import yaml

from llmplan.engine.cli import CliError, add_model_option, settle_plan
from llmplan.engine.findings import StageFailure
from llmplan.engine.runner import write_json
from llmplan.engine.serving import RequestError

from .host import ModelHost, RequestFailed
from .serve import build_host

HELP = "/reset  /save FILE  /set NAME VALUE  /system TEXT  /help  /exit"


def register(subparsers: Any) -> None:
    chat = subparsers.add_parser("chat", help="talk with the plan's model in the terminal")
    chat.add_argument("plan", nargs="?", help="the plan (with --model and no plan: the default plan)")
    chat.add_argument("--system", help="a system prompt for the conversation")
    chat.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE", help="override a parameter")
    add_model_option(chat)
    chat.set_defaults(handler=cmd_chat)


class Conversation:
    """The history and the per-conversation settings; one turn at a time through a ModelHost."""

    def __init__(self, host: ModelHost, system: str | None, out: TextIO) -> None:
        self.host, self.system, self.out = host, system, out
        self.history: list[dict[str, str]] = []
        self.settings: dict[str, Any] = {}

    def messages(self, user: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history, {"role": "user", "content": user}]

    def turn(self, user: str) -> None:
        """Stream one answer; Ctrl-C cancels it (what was shown stays in the history)."""
        tokenize: dict[str, Any] = {"messages": self.messages(user), "text": None, "prompts_file": None}
        if self.system:
            tokenize["system"] = None  # ours is already the first message
        overrides = {self.host.tokenize_id: tokenize, self.host.generate_id: {**self.settings, "stream": True}}
        shown: list[str] = []
        cancel = threading.Event()
        outcome: dict[str, Any] = {}

        def show(piece: str) -> None:
            shown.append(piece)
            self.out.write(piece)
            self.out.flush()

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
            self.out.write(" [stopped]")
        error = outcome.get("error")
        if isinstance(error, RequestError | RequestFailed | StageFailure):
            self.out.write(f"\nerror: {error}\n")
            return
        if error is not None:
            raise error
        text = "".join(shown)
        run = outcome.get("run")
        if run is not None and run.context.completions:
            final = run.context.completions[0].text
            if final.startswith(text):  # what the stream had not shown yet (an incomplete last character)
                self.out.write(final[len(text) :])
                text = final
        self.out.write("\n")
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]

    def command(self, line: str) -> bool:
        """Run a /command; False when the conversation should end."""
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        if name in ("exit", "quit"):
            return False
        if name == "reset":
            self.history.clear()
            self.say("(history cleared)")
        elif name == "save":
            if not rest:
                self.say("usage: /save FILE")
            else:
                self.save(Path(rest))
        elif name == "set":
            self.set(rest)
        elif name == "system":
            self.system = rest or None
            self.say(f"(system prompt {'set' if rest else 'removed'})")
        else:
            self.say(HELP)
        return True

    def set(self, text: str) -> None:
        key, _, value = text.partition(" ")
        if not key or not value.strip():
            self.say("usage: /set NAME VALUE (a generate parameter, e.g. /set temperature 0.2)")
            return
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value.strip()
        trial = {**self.settings, key: parsed}
        try:
            self.host.plan.bind({self.host.generate_id: trial})  # type: ignore[dict-item]
        except RequestError as bad:
            self.say(f"error: {bad}")
            return
        self.settings = trial
        self.say(f"({key} = {parsed!r})")

    def save(self, path: Path) -> None:
        record = {"plan": self.host.bound.plan.name, "system": self.system, "settings": self.settings}
        try:
            write_json(path, record | {"messages": self.history})
        except OSError as bad:
            self.say(f"error: {path}: {bad.strerror}")
            return
        self.say(f"(saved {len(self.history) // 2} turns to {path})")

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def cmd_chat(args: argparse.Namespace) -> int:
    settle_plan(args)
    host = build_host(args.plan, args.set, keep_alive_s=None, quiet=False)
    try:
        try:
            host.load()
        except StageFailure as bad:
            raise CliError(f"loading {args.plan} failed: {bad}") from None
        if host.plan.stage_by_use("output.cache") is None:
            print("note: this plan has no output.cache stage; the conversation is not stored", file=sys.stderr)
        conversation = Conversation(host, args.system, sys.stdout)
        conversation.say(f"chatting with {host.bound.plan.name} ({HELP})")
        while True:
            try:
                line = input("you> ").strip()
                if not line:
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
    finally:
        host.close()
    return 0
