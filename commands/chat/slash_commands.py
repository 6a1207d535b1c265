"""The /commands of `llmplan chat`: one table (name, arguments, one line of help) that /help prints and the
dispatcher reads, so a command cannot exist without its help. A name not in it is refused with the closest
one; `/set` shows the settings a turn takes (the plan's, and those set here) and names the closest setting
when a name is misspelt.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from llmplan.engine.runner import write_json
from llmplan.engine.serving import RequestError
from llmplan.ownership import NotOurs
from llmplan.plain_errors import plain_error
from llmplan.stages.request_settings import RequestSettings, plain_settings

if TYPE_CHECKING:
    from .command import Conversation

# What a turn may set besides the request settings (the others shape the plan's engine loop, not one answer).
TURN_EXTRAS = ("ignore_eos", "logit_bias")


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    help: str
    run: Callable[[Conversation, str], bool]  # False: the chat ends
    aliases: tuple[str, ...] = ()


def show_help(chat: Conversation, rest: str) -> bool:
    chat.say("commands (a message that starts with / is a command):")
    for command in COMMANDS:
        chat.say(f"  {('/' + command.name + ' ' + command.args).ljust(22)}{command.help}")
    chat.say('a message over several lines: begin it with """ and end it with """ (as in Ollama)')
    chat.say("Ctrl-C stops an answer (at the prompt it drops the line); Ctrl-D ends the chat")
    for note in chat.notes:
        chat.say(note)
    return True


def reset(chat: Conversation, rest: str) -> bool:
    chat.history.clear()
    chat.say("(history cleared)")
    return True


def save(chat: Conversation, rest: str) -> bool:
    if not rest:
        chat.say("usage: /save FILE")
        return True
    path = Path(rest).expanduser()
    record = {"plan": chat.host.bound.plan.name, "system": chat.system, "settings": chat.settings}
    try:
        write_json(path, record | {"messages": chat.history})
    except NotOurs as bad:  # someone else's file, a directory, a FIFO: refused, and the conversation is kept
        chat.say(f"error: /save: {bad}; the conversation is not saved (it goes on)")
        return True
    except OSError as bad:
        chat.say(f"error: /save: {plain_error(bad)}; the conversation is not saved (it goes on)")
        return True
    except ValueError:  # a NUL in the path: no file system takes it
        chat.say(f"error: /save: {rest!r} holds a NUL character, which no file name may; nothing saved")
        return True
    chat.say(f"(saved {len(chat.history) // 2} turns to {path})")
    return True


def system(chat: Conversation, rest: str) -> bool:
    chat.system = rest or None
    chat.say(f"(system prompt {'set' if rest else 'removed'})")
    return True


def leave(chat: Conversation, rest: str) -> bool:
    return False


def settings(chat: Conversation, rest: str) -> bool:
    name, _, value = rest.partition(" ")
    if not name:
        show_settings(chat)
    elif name not in turn_settings(chat):
        refuse_setting(chat, name)
    elif not value.strip():
        chat.say(f"{name} = {shown(current(chat)[name])}")
    else:
        update_setting(chat, name, value.strip())
    return True


COMMANDS = (
    Command("help", "", "this list", show_help),
    Command("set", "[NAME [VALUE]]", "show the settings, or one, or set one for the next turns", settings),
    Command("system", "[TEXT]", "set the system prompt (without TEXT: remove it)", system),
    Command("reset", "", "forget the conversation so far (the settings stay)", reset),
    Command("save", "FILE", "write the conversation, system prompt and settings to FILE as JSON", save),
    Command("exit", "", "end the chat (also /quit, or Ctrl-D)", leave, aliases=("quit",)),
)


def run_command(chat: Conversation, line: str) -> bool:
    """Run the /command on `line`; False when the conversation should end."""
    name, _, rest = line[1:].partition(" ")
    for command in COMMANDS:
        if name == command.name or name in command.aliases:
            return command.run(chat, rest.strip())
    names = [n for c in COMMANDS for n in (c.name, *c.aliases)]
    chat.say(f"error: unknown command /{name}{suggestion(name, names, '/')} (/help lists the commands)")
    return True


def suggestion(word: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


# --- /set ---------------------------------------------------------------------------------------------


def turn_settings(chat: Conversation) -> list[str]:
    """The generate stage's fields a single turn may set, in the stage's order."""
    fields = type(chat.host.generate_params).model_fields
    return [name for name in fields if name in RequestSettings.model_fields or name in TURN_EXTRAS]


def current(chat: Conversation) -> dict[str, Any]:
    """Each turn setting as the next turn takes it: the plan's value unless set in this chat."""
    plan = plain_settings({name: getattr(chat.host.generate_params, name) for name in turn_settings(chat)})
    return plan | chat.settings


def shown(value: Any) -> str:
    """A value as one would type it after /set (YAML flow: JSON)."""
    return json.dumps(value, ensure_ascii=False)


def show_settings(chat: Conversation) -> None:
    chat.say("settings of the next turns (* set in this chat; /set NAME VALUE changes one):")
    for name, value in current(chat).items():
        mark = "*" if name in chat.settings else " "
        chat.say(f" {mark}{name.ljust(22)}{shown(value)}")


def refuse_setting(chat: Conversation, name: str) -> None:
    if name in type(chat.host.generate_params).model_fields:
        where = f"{chat.host.generate_id}.{name}"
        chat.say(f"error: {name} is the plan's, not a turn's (llmplan chat --set {where}=VALUE); /set lists the others")
        return
    hint = suggestion(name, turn_settings(chat))
    chat.say(f"error: no setting {name!r}{hint} (/set lists them)")


def update_setting(chat: Conversation, name: str, value: str) -> None:
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = value
    trial = {**chat.settings, name: parsed}
    try:
        chat.host.plan.bind({chat.host.generate_id: trial})  # type: ignore[dict-item]
    except RequestError as bad:
        chat.say(f"error: {bad}")
        return
    chat.settings = trial
    chat.say(f"({name} = {parsed!r})")
