"""How a token is chosen: the request's settings, the sampler chain, picks, grammar masks, constrained formats.

The names below are its public surface: code outside llm/ imports them from here. Each is imported
from its module on first use (llmplan/lazy_exports.py), so importing the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .chain import build_picker, native_greedy
    from .constrained_format import JSON_OPTIONS, OutputFormat, UnsupportedFormat, kept_schema
    from .format_compiler import CompiledFormat, compile_format, complete
    from .params import Limit, SamplingParams, Speculation, request_fields, setting_kinds
    from .picks import Pick

EXPORTS = {  # name -> the module that defines it
    "CompiledFormat": "format_compiler",
    "JSON_OPTIONS": "constrained_format",
    "Limit": "params",
    "OutputFormat": "constrained_format",
    "Pick": "picks",
    "SamplingParams": "params",
    "Speculation": "params",
    "UnsupportedFormat": "constrained_format",
    "build_picker": "chain",
    "compile_format": "format_compiler",
    "complete": "format_compiler",
    "kept_schema": "constrained_format",
    "native_greedy": "chain",
    "request_fields": "params",
    "setting_kinds": "params",
}
__all__ = [
    "JSON_OPTIONS",
    "CompiledFormat",
    "Limit",
    "OutputFormat",
    "Pick",
    "SamplingParams",
    "Speculation",
    "UnsupportedFormat",
    "build_picker",
    "compile_format",
    "complete",
    "kept_schema",
    "native_greedy",
    "request_fields",
    "setting_kinds",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
