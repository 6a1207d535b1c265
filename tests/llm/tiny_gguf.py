"""Tiny GGUFs for the tests of a GGUF run as stored: random valid blocks of the K-quant types (gguf-py
quantizes only the legacy ones) and a small Llama/Qwen2 file with every linear in a block type."""

from __future__ import annotations

import numpy as np

from llmplan.llm.formats.gguf.block_types import BY_NAME
from llmplan.llm.formats.gguf.mapped import SCALE_OFFSETS


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks of a K-quant type (gguf-py quantizes only the legacy ones): random bytes, each fp16
    scale finite in [-1/16, 1/16]; uint8 [rows, row bytes]."""
    t = BY_NAME[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * (k // t.block_size), t.type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS[name]:
        raw[:, off : off + 2] = rng.uniform(-1 / 16, 1 / 16, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def scaled_blocks(name: str, rows: int, k: int, seed: int, std: float = 0.06) -> np.ndarray:
    """`random_blocks` whose dequantized weights have about `std` (the fp16 scales multiplied, so every value
    scales alike), as trained weights have: random scales in [-1/16, 1/16] make weights of tens."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    probe = random_blocks(name, rows, k, seed)
    factor = std / float(dequantize(probe, Q[name]).std())
    raw = probe.reshape(-1, BY_NAME[name].type_size).copy()
    for off in SCALE_OFFSETS[name]:
        halves = raw[:, off : off + 2].copy().view(np.float16) * np.float16(factor)
        raw[:, off : off + 2] = halves.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2
# A Q4_K_M file's mix: q/k/o/gate/up Q4_K, v and down Q6_K, norms F32
LAYER_TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
}


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable-character table, to spell a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _block(name: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if name.endswith("_K"):
        return scaled_blocks(name, shape[0], shape[1], int(rng.integers(1 << 30)))
    w = (rng.standard_normal(shape) * 0.06).astype(np.float32)
    return np.ascontiguousarray(quantize(w, Q[name])).view(np.uint8).reshape(shape[0], -1)


def write_tiny_model(
    path: str,
    arch: str = "llama",
    tied: bool = False,
    embed: str = "Q4_K",
    head: str = "Q6_K",
    seed: int = 0,
    name: str | None = None,
) -> None:
    """A 2-layer Llama or Qwen2 GGUF with a byte-level vocabulary, its linears in a Q4_K_M-like mix of block
    types (`LAYER_TYPES`), the embeddings `embed`, an untied head `head` (none when `tied`); `name`: its
    `general.name`, if any."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_alphabet(), "Ġt", "he"]
    writer = gguf.GGUFWriter(path, arch)
    if name is not None:
        writer.add_name(name)
    for add, value in (
        (writer.add_block_count, LAYERS),
        (writer.add_context_length, 4096),
        (writer.add_embedding_length, DIM),
        (writer.add_feed_forward_length, FFN),
        (writer.add_head_count, HEADS),
        (writer.add_head_count_kv, KV_HEADS),
        (writer.add_rope_dimension_count, HEAD_DIM),
        (writer.add_rope_freq_base, 10000.0),
        (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_vocab_size, len(tokens)),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "smollm"),
        (writer.add_token_list, tokens),
        (writer.add_token_types, [3, 3, 3] + [1] * (len(tokens) - 3)),
        (writer.add_token_merges, ["Ġ t", "h e"]),
        (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2),
        (writer.add_chat_template, "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"),
    ):
        add(value)

    def put(name: str, type_name: str, shape: tuple[int, int]) -> None:
        writer.add_tensor(name, _block(type_name, shape, rng), raw_dtype=Q[type_name])

    def vector(name: str, n: int, base: float = 1.0) -> None:
        writer.add_tensor(name, (base + 0.1 * rng.standard_normal(n)).astype(np.float32))

    put("token_embd.weight", embed, (len(tokens), DIM))
    rows = {"attn_q": HEADS * HEAD_DIM, "attn_k": KV_HEADS * HEAD_DIM, "attn_v": KV_HEADS * HEAD_DIM}
    rows |= {"attn_output": DIM, "ffn_gate": FFN, "ffn_up": FFN, "ffn_down": DIM}
    for i in range(LAYERS):
        vector(f"blk.{i}.attn_norm.weight", DIM)
        vector(f"blk.{i}.ffn_norm.weight", DIM)
        for short, type_name in LAYER_TYPES.items():
            k = FFN if short == "ffn_down" else HEADS * HEAD_DIM if short == "attn_output" else DIM
            put(f"blk.{i}.{short}.weight", type_name, (rows[short], k))
        if arch == "qwen2":
            for short in ("attn_q", "attn_k", "attn_v"):
                vector(f"blk.{i}.{short}.bias", rows[short], base=0.0)
    vector("output_norm.weight", DIM)
    if not tied:
        put("output.weight", head, (len(tokens), DIM))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
