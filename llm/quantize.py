"""Compatibility: `llm.quantize` was split into `llm.weight_formats` (the weight containers, quantize,
dequantize, error measures, serialization) and `llm.linear` (the linear modules and their kernel paths).
Import from those; this module only re-exports them for code written against the old name."""

from __future__ import annotations

from .linear import FloatLinear, Int4Linear, Int8Linear, Kernel, kernel_paths, make_linear
from .weight_formats import (
    DEFAULT_GROUP_SIZE,
    FLOAT_DTYPES,
    QUANT_DTYPES,
    Int4Weight,
    Int8Weight,
    QuantDtype,
    QuantizedWeight,
    concat_quantized,
    dequantize,
    error_terms,
    from_tensors,
    nbytes,
    quantize_weight,
    relative_error,
    relative_from_terms,
    to_tensors,
)

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "FLOAT_DTYPES",
    "QUANT_DTYPES",
    "FloatLinear",
    "Int4Linear",
    "Int4Weight",
    "Int8Linear",
    "Int8Weight",
    "Kernel",
    "QuantDtype",
    "QuantizedWeight",
    "concat_quantized",
    "dequantize",
    "error_terms",
    "from_tensors",
    "kernel_paths",
    "make_linear",
    "nbytes",
    "quantize_weight",
    "relative_error",
    "relative_from_terms",
    "to_tensors",
]
