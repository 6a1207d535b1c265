"""Shared fixtures of the llm tests: every native-kernel test runs on each instruction-set path.

`isa_path` makes `native.kernels()` return the AVX2 build, then the AVX-512 one (module-scoped, so a module's
tests run on one path, then the other). On a CPU without AVX-512 the AVX-512 runs skip and say why.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmplan.llm.kernels import native


@pytest.fixture(scope="module", params=list(native.ISAS))
def isa_path(request: pytest.FixtureRequest) -> Iterator[native.NativeKernels]:
    isa: str = request.param
    if native.kernels() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    if not native.cpu_has(isa):
        pytest.skip(f"this CPU (or its OS) cannot run the {isa} kernels")
    fast = native.kernels_for(isa)
    if fast is None:
        pytest.skip(f"the {isa} build of the native kernels failed")
    saved = native._loaded
    native._loaded = fast
    try:
        yield fast
    finally:
        native._loaded = saved
