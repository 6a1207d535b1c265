"""llmplan bounds OpenMP spinning for itself (#30, llmplan/openmp_env.py), not for the programs it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmplan import openmp_env


def test_a_fresh_process_gets_the_bound_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    code = "import llmplan, os, sys; import torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == openmp_env.SPINCOUNT


def test_the_users_own_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openmp_env, "_set_here", False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    openmp_env.bound_spinning()
    assert os.environ["GOMP_SPINCOUNT"] == "123"
    assert openmp_env.foreign_env()["GOMP_SPINCOUNT"] == "123"


def test_other_programs_run_without_the_bound_llmplan_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openmp_env, "_set_here", True)
    monkeypatch.setenv("GOMP_SPINCOUNT", openmp_env.SPINCOUNT)
    env = openmp_env.foreign_env(LLAMA_CPU="avx2")
    assert "GOMP_SPINCOUNT" not in env and env["LLAMA_CPU"] == "avx2"
    assert os.environ["GOMP_SPINCOUNT"] == openmp_env.SPINCOUNT  # this process keeps it
