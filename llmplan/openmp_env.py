"""Bounded spinning of OpenMP threads (#30), set before torch loads libgomp; other programs' env without it.

An OpenMP thread that waits for work spins GOMP_SPINCOUNT times, then sleeps. libgomp's default, 300000
(~3 ms), keeps a thread that the native kernels' adapted team left out (llm/kernels/cpu_kernels.c, "Threads on a
busy machine") spinning after every torch op, taking CPU from the thread doing the work when other jobs hold
the cores. SPINCOUNT (~0.3 ms) still spans every gap between the products of a forward pass (microseconds);
fully passive waiting lost half the quiet decode speed (a sleep and a wake-up at each of ~150 products a
token). libgomp reads the variable once, when torch loads it: so only where torch is not imported yet, and
never over the user's own setting. The programs llmplan starts (llama.cpp, for the benchmarks: OpenMP too)
get the environment without it (`foreign_env`), so they run as they would on their own.
"""

from __future__ import annotations

import os
import sys

SPINCOUNT = "30000"
_set_here = False


def bound_spinning() -> None:
    global _set_here
    if "torch" not in sys.modules and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPINCOUNT
        _set_here = True


def foreign_env(**extra: str) -> dict[str, str]:
    """os.environ (plus `extra`) for another program: without the GOMP_SPINCOUNT that llmplan set itself."""
    env = dict(os.environ, **extra)
    if _set_here and env.get("GOMP_SPINCOUNT") == SPINCOUNT:
        del env["GOMP_SPINCOUNT"]
    return env
