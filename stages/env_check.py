"""`env.check`: Python, torch and library versions, the device, and threads — recorded for the run."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import Field

from llmplan.engine import heap
from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage

from .slots import InferenceContext
from .types import Environment

PACKAGES = ("torch", "safetensors", "tokenizers", "gguf", "pydantic", "numpy")


class EnvParams(Params):
    require_cuda: bool = Field(False, description="fail unless a CUDA device is present")


def resolve_device(requested: str) -> str:
    """'auto' → the first CUDA device when present, else CPU; an explicit 'cuda' must exist."""
    import torch

    if requested == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise StageFailure(f"device: {requested!r} was asked for, but this machine has no CUDA device")
        index = int(requested.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise StageFailure(f"device: {requested!r} does not exist ({torch.cuda.device_count()} CUDA device(s))")
        return f"cuda:{index}"
    if requested == "mps" and not torch.backends.mps.is_available():
        raise StageFailure("device: 'mps' was asked for, but it is not available")
    return requested


def native_kernels_status(device: str) -> str:
    """Whether the CPU decode kernels (llm/kernels/cpu_kernels.c) run here; built now, not at the first token."""
    if not device.startswith("cpu"):
        return f"not used on {device}"
    from llmplan.llm.kernels import native

    return native.describe()  # names the instruction-set path taken (avx512 or avx2) and why


class EnvCheck(Stage):
    """Check Python, torch and the device; pick CUDA when present (device: auto)."""

    name = "env.check"
    phase = Phase.LOAD
    Params = EnvParams
    writes = ("environment",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        import torch

        plan = ctx.plan.plan
        device = resolve_device(plan.device)
        if params.require_cuda and not device.startswith("cuda"):
            raise StageFailure("env.check: require_cuda is set, but no CUDA device is present")
        if plan.threads:
            torch.set_num_threads(plan.threads)
        ctx.metrics.set("allocator_tuned", heap.for_loading())  # load.to_device sets it for decoding
        torch.manual_seed(plan.seed)
        packages = {}
        for name in PACKAGES:
            try:
                packages[name] = version(name)
            except PackageNotFoundError:
                packages[name] = "missing"
        name, memory = "cpu", None
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(torch.device(device))
            name, memory = props.name, int(props.total_memory)
        else:
            name = platform.processor() or platform.machine()
        ctx.device = device
        ctx.environment = Environment(
            python=platform.python_version(),
            torch=torch.__version__,
            packages=packages,
            device=device,
            device_name=name,
            threads=torch.get_num_threads(),
            device_memory_bytes=memory,
        )
        ctx.metrics.set("device", device)
        ctx.metrics.set("threads", torch.get_num_threads())
        kernels = native_kernels_status(device)
        ctx.metrics.set("native_kernels", kernels)
        facts = {k: v for k, v in vars(ctx.environment).items() if k != "packages"}
        ctx.log.info("environment", native_kernels=kernels, **facts)

    def check(self, params: Any, deep: DeepCheck) -> None:
        try:
            device = resolve_device(deep.plan.plan.device)
        except StageFailure as bad:
            deep.problem(str(bad))
            return
        if params.require_cuda and not device.startswith("cuda"):
            deep.problem("require_cuda is set, but no CUDA device is present", "require_cuda")
        deep.facts["device"] = device
        deep.capacity = available_memory(device)


def available_memory(device: str) -> tuple[str, int]:
    """What a plan's memory estimate must fit in: the GPU's free memory, or the host's available RAM."""
    import torch

    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return f"free memory on {device}", int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return "available host memory", int(line.split()[1]) * 1024
    except OSError:
        pass
    return "host memory", 1 << 62
