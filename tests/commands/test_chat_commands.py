"""chat_commands: /help lists every command, unknown ones and misspelt settings get the closest name, /set
shows the settings the next turn takes (the plan's tiny model; nothing is loaded)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmplan.commands.chat.command import Conversation
from llmplan.commands.chat.slash_commands import COMMANDS
from llmplan.commands.serve.command import build_host

from .conftest import write_serve_plan


@pytest.fixture()
def chat(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[Conversation, io.StringIO]]:
    plan = write_serve_plan(tmp_path, tiny_model, slots=1, temperature=0.7)
    host = build_host(str(plan), [], keep_alive_s=None, run_dir=tmp_path / "run")
    out = io.StringIO()
    try:
        yield Conversation(host, None, out), out
    finally:
        host.close()


def said(chat: tuple[Conversation, io.StringIO], line: str) -> str:
    conversation, out = chat
    out.seek(0)
    out.truncate()
    assert conversation.command(line)
    return out.getvalue()


def test_help_lists_each_command_once(chat: tuple[Conversation, io.StringIO]) -> None:
    shown = said(chat, "/help")
    for command in COMMANDS:
        assert sum(line.lstrip().startswith(f"/{command.name} ") for line in shown.splitlines()) == 1
    assert '"""' in shown


def test_unknown_command_is_refused_with_a_suggestion(chat: tuple[Conversation, io.StringIO]) -> None:
    assert said(chat, "/sav x.json").startswith("error: unknown command /sav; did you mean /save?")
    assert "did you mean" not in said(chat, "/zzzz") and "error: unknown command /zzzz" in said(chat, "/zzzz")
    assert not chat[0].command("/quit")


def test_set_shows_current_values_and_suggests_names(chat: tuple[Conversation, io.StringIO]) -> None:
    table = said(chat, "/set")
    assert "  temperature" in table and "0.7" in table.split("temperature", 1)[1].splitlines()[0]
    assert "(temperature = 0.2)" in said(chat, "/set temperature 0.2")
    row = next(line for line in said(chat, "/set").splitlines() if "temperature" in line)
    assert row.startswith(" *") and row.endswith("0.2")
    assert said(chat, "/set temperature").strip() == "temperature = 0.2"
    assert "did you mean temperature?" in said(chat, "/set temprature 1")
    assert "the plan's" in said(chat, "/set num_beams 2") and "num_beams" not in chat[0].settings
    assert said(chat, "/set top_k -3").startswith("error: top_k") and chat[0].settings == {"temperature": 0.2}
