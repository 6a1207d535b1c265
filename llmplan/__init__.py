"""llmplan: a declarative workflow engine for LLM inference."""

from importlib.metadata import PackageNotFoundError, version

from .openmp_env import bound_spinning

bound_spinning()

try:
    __version__ = version("llmplan")  # stated once, in pyproject.toml
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"
