"""Every test runs with its own data home, so the suite never writes into the user's ~/.local/share/llmplan.

`LLMPLAN_HOME` is set when this file is imported (before any session fixture runs a plan) to a session folder,
then, for each test, to that test's tmp_path: the runs, results database and relative sink files a test makes
land beside its other files, and subprocesses inherit it. The conversion cache's entries
(`LLMPLAN_CONVERSION_CACHE`) likewise: a test's second run maps what its first converted, another test's never.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from llmplan.data_home import HOME_VARIABLE
from llmplan.llm.formats.conversion_cache.listing import ROOT_VARIABLE as CONVERSIONS_VARIABLE

_SESSION_HOME = tempfile.mkdtemp(prefix="llmplan-test-home-")
os.environ[HOME_VARIABLE] = _SESSION_HOME
os.environ[CONVERSIONS_VARIABLE] = os.path.join(_SESSION_HOME, "conversions")
atexit.register(shutil.rmtree, _SESSION_HOME, True)


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(HOME_VARIABLE, str(tmp_path))
    # each test's own conversion cache: a conversion kept by one test must not change what another measures
    monkeypatch.setenv(CONVERSIONS_VARIABLE, str(tmp_path / "conversions"))
    return tmp_path
