"""The layer-name table against the model it names: every weighted module of a block, every linear weight."""

from __future__ import annotations

from pathlib import Path

from tiny import load_tiny, make_tiny_llama
from torch import nn

from llmplan.llm.model import HEAD_NAME, LAYER_MODULES, LINEAR_NAMES, internal_shapes, is_linear_weight


def test_the_table_names_every_weighted_module_of_a_block(tmp_path: Path) -> None:
    path, _ = make_tiny_llama(tmp_path)
    model = load_tiny(path)
    block = model.layers[0]
    # the modules holding weights of their own (registration order is not forward order: compare as sets)
    weighted = [
        name for name, m in block.named_modules() if name and next(m.parameters(recurse=False), None) is not None
    ]
    assert sorted(weighted) == sorted(LAYER_MODULES)
    assert all(isinstance(block.get_submodule(rel), nn.Linear) for rel in LINEAR_NAMES)
    assert isinstance(model.get_submodule(HEAD_NAME), nn.Linear)


def test_linear_weights_are_the_matrices_of_the_linears(tmp_path: Path) -> None:
    path, _ = make_tiny_llama(tmp_path)
    cfg = load_tiny(path).cfg
    linear = {name for name in internal_shapes(cfg) if is_linear_weight(name)}
    want = {f"layers.{i}.{rel}.weight" for i in range(cfg.n_layers) for rel in LINEAR_NAMES} | {"output.weight"}
    assert linear == want
    assert not is_linear_weight("tok_embeddings.weight")
    assert not is_linear_weight("layers.0.attention_norm.weight")
