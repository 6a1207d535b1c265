"""The model itself: config, families, weight names and formats, the linear kernels' modules, the transformer.

The names below are its public surface: code outside llm/ imports them from here. Each is imported
from its module on first use (llmplan/lazy_exports.py), so importing the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .config import ConfigError, ModelConfig
    from .layer_clock import LayerClock
    from .layer_names import HEAD_NAME, LAYER_MODULES, LINEAR_NAMES, is_linear_weight
    from .linear import kernel_paths, make_linear
    from .transformer import Transformer
    from .weight_formats import (
        FLOAT_DTYPES,
        Int4Weight,
        QuantDtype,
        concat_quantized,
        dequantize,
        error_terms,
        from_tensors,
        nbytes,
        quantize_weight,
        relative_from_terms,
        to_tensors,
        value_problem,
        value_range,
    )
    from .weights import WeightError, expected_hf_names, fusion_table, internal_shapes, layout_problems

EXPORTS = {  # name -> the module that defines it
    "ConfigError": "config",
    "FLOAT_DTYPES": "weight_formats",
    "HEAD_NAME": "layer_names",
    "Int4Weight": "weight_formats",
    "LAYER_MODULES": "layer_names",
    "LINEAR_NAMES": "layer_names",
    "LayerClock": "layer_clock",
    "ModelConfig": "config",
    "QuantDtype": "weight_formats",
    "Transformer": "transformer",
    "WeightError": "weights",
    "concat_quantized": "weight_formats",
    "dequantize": "weight_formats",
    "error_terms": "weight_formats",
    "expected_hf_names": "weights",
    "from_tensors": "weight_formats",
    "fusion_table": "weights",
    "internal_shapes": "weights",
    "is_linear_weight": "layer_names",
    "kernel_paths": "linear",
    "layout_problems": "weights",
    "make_linear": "linear",
    "nbytes": "weight_formats",
    "quantize_weight": "weight_formats",
    "relative_from_terms": "weight_formats",
    "to_tensors": "weight_formats",
    "value_problem": "weight_formats",
    "value_range": "weight_formats",
}
__all__ = [
    "FLOAT_DTYPES",
    "HEAD_NAME",
    "LAYER_MODULES",
    "LINEAR_NAMES",
    "ConfigError",
    "Int4Weight",
    "LayerClock",
    "ModelConfig",
    "QuantDtype",
    "Transformer",
    "WeightError",
    "concat_quantized",
    "dequantize",
    "error_terms",
    "expected_hf_names",
    "from_tensors",
    "fusion_table",
    "internal_shapes",
    "is_linear_weight",
    "kernel_paths",
    "layout_problems",
    "make_linear",
    "nbytes",
    "quantize_weight",
    "relative_from_terms",
    "to_tensors",
    "value_problem",
    "value_range",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
