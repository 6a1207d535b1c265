"""A forward pass of the whole model in one native call (`forward_pass` in cpu_kernels.c): decode steps,
prompt chunks, or both at once.

At batch 1 on a small model, the torch decoder spends as long dispatching ~30 small ops per layer (norms,
views, RoPE, SDPA, residuals) as multiplying: 36 ms per SmolLM2 token with the native GEMMs, of which the
products are ~10; a 128-token prefill spent a fifth of its time outside the products. The fused pass runs the
same arithmetic with no per-op dispatch.

A pass is a list of inputs, each a token at (cache row, slot, RoPE position). A decode row is one input
(`step`, `step_rows`); a prompt chunk is one row's inputs at consecutive slots (`run`, `native_static_prefill`): every
input's K/V is stored before any input attends, so the chunk attends causally to itself. `run` takes the
inputs whose logits are wanted, so a prefill pays for the head once, and a scheduler step puts its decode
rows and prompt chunks into one pass.

`FusedDecoder.build(model, cache)` checks that the model fits, and returns None (the model runner keeps the
torch modules, llm/generation/model_runner.py) otherwise: CPU, fp32 activations, an fp32, fp16 or bf16 KV cache
(16-bit K/V are rounded as torch casts them and widened per attention chunk), every linear layer on a
native kernel (fp32, bf16, fp16, int8, int4, a GGUF's own blocks), in-features a multiple of 8. A GGUF as stored
(`load.convert` dtype `stored`) runs on its blocks: the same gguf_blocks.c products as its torch modules
(LINEAR_GGUF; a fused q|k|v of differing block types is LINEAR_PARTS, each part writing its own columns), the
embedding rows dequantized per token from the block table (a tied head multiplies by that same table).
Observers that hook the torch modules ask the runner for those instead. Per-layer timings need no hooks: the
pass writes its own clock marks into the runner's `LayerClock`. The pointers it hands to C belong to tensors it
keeps references to: a model moved or cast, or another cache, needs a new runner.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..kernels import native
from ..model.gguf_embedding import GGUFEmbedding
from ..model.linear import FloatLinear, GGUFLinear, GGUFPartsLinear, Int4Linear, Int8Linear

if TYPE_CHECKING:
    from ..kv.cache import KVCache
    from ..model.config import ModelConfig
    from ..model.layer_clock import LayerClock
    from ..model.transformer import Transformer

_F32, _INT8, _INT4, _BF16, _F16, _BF16_INPUTS, _GGUF, _PARTS = range(8)  # Linear kinds (cpu_kernels.c)
# ggml's float types run where GGUFLinear runs them: on the fp32 and half kernels (native.py _GGUF_FLOATS)
_GGUF_FLOAT_KINDS = {0: _F32, 1: _F16, 30: _BF16}
_HALF_KINDS = {torch.bfloat16: _BF16, torch.float16: _F16}
_KV_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # KV_F32, KV_F16, KV_BF16


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("zero", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("xbits", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("ffn_norm", ctypes.c_void_p),
        ("wqkv", _Linear),
        ("wo", _Linear),
        ("w13", _Linear),
        ("w2", _Linear),
        *((name, ctypes.c_void_p) for name in ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "hidden")),
        *((name, ctypes.c_int64) for name in ("vocab", "max_batch", "max_tokens")),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("embed", "rope_cos", "rope_sin", "norm")),
        ("head", _Linear),
        ("layers", ctypes.POINTER(_Layer)),
        ("valid", ctypes.c_void_p),
        ("layer_ns", ctypes.c_void_p),  # a LayerClock's buffer while one observes, else NULL
        ("kv_format", ctypes.c_int64),
        ("gelu", ctypes.c_int64),
        ("embed_type", ctypes.c_int64),  # 0: an fp32 table; else a GGUF block table of this ggml type
        *((name, ctypes.c_float) for name in ("embed_scale", "attn_scale", "attn_softcap", "final_softcap")),
    ]


class NotFused(Exception):
    """The model or cache does not fit the fused step; the message says why."""


NATIVE_DEPARTURES = frozenset(
    {
        "q/k/v biases", "q/k norms", "Gemma's extra norms", "norm offset", "GeGLU", "embedding scale",
        "sliding windows", "attention scale", "soft-capping", "local RoPE base",
    }
)  # fmt: skip
"""What `forward_pass` computes beyond Llama (the norm offset is folded into the weights at load)."""


def architecture_problem(cfg: ModelConfig) -> str | None:
    """Why the native pass cannot compute this architecture (llm/model/architecture.py), or None when it can.

    Anything the C pass does not implement must send the model to the torch reference: never a wrong answer."""
    arch = cfg.arch
    departures = {
        "q/k/v biases": arch.qkv_bias,
        "q/k norms": arch.qk_norm,
        "Gemma's extra norms": arch.sandwich_norms,
        "norm offset": bool(arch.norm_offset),
        "GeGLU": arch.activation != "silu",
        "embedding scale": arch.embed_scale,
        "sliding windows": any(cfg.layer_windows),
        "attention scale": cfg.attn_scale is not None,
        "soft-capping": cfg.attn_softcap is not None or cfg.final_softcap is not None,
        "local RoPE base": cfg.rope_local_theta is not None and any(cfg.layer_windows),
    }
    missing = [name for name, needed in departures.items() if needed and name not in NATIVE_DEPARTURES]
    return f"the native pass lacks {', '.join(missing)} ({cfg.model_type})" if missing else None


def mirror_layout() -> list[int]:
    """Sizes and field offsets of the ctypes mirror, in the order `decode_layout` in cpu_kernels.c reports."""
    fields = {
        _Linear: ("w", "scale", "zero", "n", "k", "group", "xbits"),
        _Layer: (
            *("ffn_norm", "wqkv", "wo", "w13", "w2", "qkv_bias", "q_norm", "k_norm"),
            *("post_attn_norm", "post_ffn_norm", "rope_cos", "rope_sin", "window", "k_cache", "v_cache", "rows"),
        ),
        _Model: (
            *("max_batch", "eps", "embed", "norm", "head", "layers"),
            *("valid", "layer_ns", "kv_format", "gelu", "embed_type"),
            *("embed_scale", "attn_scale", "attn_softcap", "final_softcap"),
        ),
    }
    out: list[int] = []
    for struct, names in fields.items():
        out.append(ctypes.sizeof(struct))
        out.extend(getattr(struct, name).offset for name in names)
    return out


def check_layout(lib: Any) -> None:
    """Refuse (NotFused) when the compiled structs and the ctypes mirror disagree: handing the C code a
    struct it reads at other offsets would corrupt memory rather than fail."""
    want = mirror_layout()
    buf = (ctypes.c_int64 * 64)()
    n = lib.decode_layout(buf, len(buf))
    native_layout = list(buf[: min(n, len(buf))])
    if native_layout != want:
        raise NotFused(f"the fused step's C structs {native_layout} differ from their ctypes mirror {want}")


def _gguf_blocks(blocks: Tensor, qtype: int, n: int, k: int) -> None:
    """NotFused unless `blocks` are n whole rows of `qtype` blocks over k columns, contiguous uint8 on the CPU:
    the C pass reads n * row bytes from the pointer, so a short or strided tensor must never reach it."""
    fast = native.kernels()
    shape = fast.gguf_block_shape(qtype) if fast is not None else None
    if shape is None or n <= 0 or k <= 0 or k % shape[0]:
        raise NotFused(f"GGUF type {qtype} over {k} columns is not one the native pass reads")
    if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or not blocks.is_contiguous():
        raise NotFused("GGUF blocks that are not a contiguous uint8 CPU tensor")
    if blocks.numel() != n * (k // shape[0]) * shape[1]:
        raise NotFused(f"GGUF blocks of {blocks.numel()} bytes for [{n}, {k}] of type {qtype}")


def _gguf_linear(module: GGUFLinear, keep: list[Any]) -> _Linear:
    """LINEAR_GGUF over the file's blocks (group: the ggml type); a float GGUF type on the kernel its module
    runs (fp32, fp16, bf16)."""
    if module.kernel != "auto" or not module._chosen().startswith("native-"):
        raise NotFused("a GGUF layer has no native kernel")
    n, k, qtype = module.out_features, module.in_features, module.qtype
    _gguf_blocks(module.blocks, qtype, n, k)
    kind = _GGUF_FLOAT_KINDS.get(qtype, _GGUF)
    if k % 8:
        raise NotFused(f"a GGUF weight of {k} columns does not fit the native kernels")
    keep.append(module.blocks)
    return _Linear(kind, module.blocks.data_ptr(), 0, 0, n, k, qtype if kind == _GGUF else 0, module.activation_bits)


def _gguf_parts(module: GGUFPartsLinear, keep: list[Any]) -> _Linear:
    """LINEAR_PARTS: w is an array of the parts' LINEAR_GGUF (kept alive in `keep`), group their count."""
    parts = [_gguf_linear(part, keep) for part in module.parts]
    if any(p.kind != _GGUF for p in parts):
        raise NotFused("a fused GGUF layer with a float part")  # the C parts write through an output stride
    if sum(p.n for p in parts) != module.out_features or any(p.k != module.in_features for p in parts):
        raise NotFused("a fused GGUF layer whose parts do not make its shape")
    array = (_Linear * len(parts))(*parts)
    keep.append(array)
    return _Linear(_PARTS, ctypes.addressof(array), 0, 0, module.out_features, module.in_features, len(parts))


def _native_linear(module: nn.Module, keep: list[Any]) -> _Linear:
    """The C description of one linear layer, or NotFused when it is not on a native kernel."""
    if isinstance(module, GGUFLinear):
        return _gguf_linear(module, keep)
    if isinstance(module, GGUFPartsLinear):
        return _gguf_parts(module, keep)
    zero: Tensor | None = None
    group = 0
    if isinstance(module, FloatLinear) and module.kernel == "auto" and module.weight.dtype == torch.float32:
        w, scale, kind = module.weight, None, _F32
    elif isinstance(module, FloatLinear) and module.kernel == "auto" and module.weight.dtype in _HALF_KINDS:
        w, scale, kind = module.weight, None, _BF16_INPUTS if module._rounds_x else _HALF_KINDS[module.weight.dtype]
    elif isinstance(module, Int8Linear) and module.kernel == "auto":
        w, scale, kind = module.qweight, module.scale.float().contiguous(), _INT8
    elif isinstance(module, Int4Linear) and module.kernel == "auto":
        path = module._chosen()
        if module.int8 is not None:  # the int8 re-quantization (groups the int4 kernel does not take)
            w, scale, kind = module.int8[0], module.int8[1], _INT8
        elif path.startswith("native-"):
            w, scale, zero, kind, group = module.packed, module.scale, module.zero, _INT4, module.group_size
        else:
            raise NotFused("an int4 layer has no native kernel")
    elif isinstance(module, nn.Linear) and module.bias is None and module.weight.dtype == torch.float32:
        w, scale, kind = module.weight, None, _F32
    else:
        raise NotFused(f"{type(module).__name__} is not on a native kernel")
    in_features = w.shape[1] * (2 if kind == _INT4 else 1)
    if w.device.type != "cpu" or not w.is_contiguous() or in_features % 8:
        raise NotFused(f"a weight of shape {tuple(w.shape)} does not fit the native kernels")
    keep.extend(t for t in (w, scale, zero) if t is not None)
    return _Linear(
        kind,
        w.data_ptr(),
        0 if scale is None else scale.data_ptr(),
        0 if zero is None else zero.data_ptr(),
        w.shape[0],
        in_features,
        group,
    )


def _native_embed(model: Transformer, keep: list[Any]) -> tuple[int, int]:
    """(address, ggml type) of the embedding table: an fp32 table (type 0), or a GGUF's block table, whose
    rows the pass dequantizes per token as GGUFEmbedding does."""
    table = model.tok_embeddings
    if isinstance(table, GGUFEmbedding):
        shape = (table.num_embeddings, table.embedding_dim)
        if table.dtype != torch.float32 or shape != (model.cfg.vocab_size, model.cfg.dim):
            raise NotFused(f"a GGUF embedding of {shape} in {table.dtype}")
        _gguf_blocks(table.blocks, table.qtype, *shape)
        keep.append(table.blocks)
        return table.blocks.data_ptr(), table.qtype
    if not isinstance(table, nn.Embedding):
        raise NotFused(f"the embeddings are {type(table).__name__}, not a table")
    return _ptr(table.weight, keep), 0


def _ptr(t: Tensor, keep: list[Any]) -> int:
    if not t.is_contiguous() or t.dtype != torch.float32 or t.device.type != "cpu":
        raise NotFused(f"a {t.dtype} tensor on {t.device} is not contiguous fp32 on the CPU")
    keep.append(t)
    return t.data_ptr()


def _fusable_kv_format(model: Transformer, cache: KVCache) -> int:
    """The KV cache's format code for the native step (_KV_FORMATS); NotFused naming what the step cannot run:
    the architecture, activations other than fp32 on the CPU, the cache's type, place or layout, the heads."""
    cfg = model.cfg
    problem = architecture_problem(cfg)
    if problem:
        raise NotFused(problem)
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise NotFused(f"activations are {model.dtype} on {model.device}")
    store = cache.store
    kv_format = _KV_FORMATS.get(store.dtype)
    if kv_format is None or store.device.type != "cpu":
        raise NotFused(f"the KV cache is {store.dtype} on {store.device}")
    if not all(t.is_contiguous() for t in (*store.k, *store.v)):
        raise NotFused("the KV cache is not contiguous")
    if cfg.head_dim % 2 or cfg.n_heads % cfg.n_kv_heads:
        raise NotFused("odd head_dim or heads not grouped evenly")
    if kv_format and cfg.head_dim % 8:
        raise NotFused(f"a 16-bit KV cache needs head_dim % 8 == 0, not {cfg.head_dim}")
    return kv_format


def _native_layers(model: Transformer, cache: KVCache, keep: list[Any]) -> Any:
    """The `_Layer` array of the model's blocks: their weights' and KV rows' addresses (the tensors behind them
    appended to `keep`, which must outlive the array)."""
    store = cache.store
    layers = (_Layer * model.cfg.n_layers)()

    def optional(module: nn.Module | None) -> int | None:  # a norm or bias the layer may not have
        return None if module is None else _ptr(module.weight, keep)

    for i, block in enumerate(model.layers):
        attention = block.attention
        local = attention.local_rope and model.rope_local_cos is not None and model.rope_local_sin is not None
        cos, sin = (model.rope_local_cos, model.rope_local_sin) if local else (model.rope_cos, model.rope_sin)
        layers[i] = _Layer(
            _ptr(block.attention_norm.weight, keep),
            _ptr(block.ffn_norm.weight, keep),
            _native_linear(attention.wqkv, keep),
            _native_linear(attention.wo, keep),
            _native_linear(block.feed_forward.w13, keep),
            _native_linear(block.feed_forward.w2, keep),
            optional(attention.wqkv_bias),
            optional(attention.q_norm),
            optional(attention.k_norm),
            optional(block.post_attention_norm),
            optional(block.post_ffn_norm),
            _ptr(cos, keep),  # type: ignore[arg-type]
            _ptr(sin, keep),  # type: ignore[arg-type]
            attention.window,
            store.k[i].data_ptr(),  # [max_batch, kv_heads, rows, head_dim] of this layer
            store.v[i].data_ptr(),
            store.rows[i],
        )
    return layers


class FusedDecoder:
    """A native decode step bound to one model and one KV cache."""

    def __init__(self, model: Transformer, cache: KVCache, lib: Any) -> None:
        cfg = model.cfg
        keep: list[Any] = []  # the tensors (and ctypes part arrays) behind every address handed to C
        embed, embed_type = _native_embed(model, keep)
        kv_format = _fusable_kv_format(model, cache)
        store = cache.store
        layers = _native_layers(model, cache, keep)
        valid = cache.valid
        keep.append(valid)
        self.model_struct = _Model(
            cfg.n_layers,
            cfg.dim,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
            cache.max_batch,
            cache.max_tokens,
            cfg.norm_eps,
            embed,
            _ptr(model.rope_cos, keep),
            _ptr(model.rope_sin, keep),
            _ptr(model.norm.weight, keep),
            _native_linear(model.output, keep),
            layers,
            valid.data_ptr(),
            None,
            kv_format,
            int(cfg.arch.activation == "gelu_tanh"),
            embed_type,
            cfg.dim**0.5 if cfg.arch.embed_scale else 1.0,  # rounded to fp32 as the torch path rounds it
            cfg.attn_scale or 0.0,
            cfg.attn_softcap or 0.0,
            cfg.final_softcap or 0.0,
        )
        keep += [t for group in store.groups for t in group]
        self.clock: LayerClock | None = None  # set by the model runner before each pass
        self._layers = layers
        self._keep = keep
        self._lib = lib
        per_row = 2 * cfg.dim + (cfg.n_heads + 2 * cfg.n_kv_heads + cfg.n_heads) * cfg.head_dim
        self._per_row = per_row + 3 * cfg.intermediate_size
        self._work = torch.empty(0)
        self.vocab = cfg.vocab_size

    @classmethod
    def build(cls, model: Transformer, cache: KVCache) -> FusedDecoder | None:
        fast = native.kernels()
        if fast is None:
            return None
        try:
            check_layout(fast.lib)
            return cls(model, cache, fast.lib)
        except NotFused:
            return None

    def step(self, tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """Logits [B, 1, V] (fp32) of one new token per active row of a static batch; appends its K/V."""
        rows = tokens.shape[0]
        token_ids = tokens.reshape(rows).contiguous()
        pos = positions.reshape(rows).clone()  # before append: positions may be a view of the cache's
        self._check_ids(token_ids)
        slot = cache.append(positions)
        row_ids = torch.arange(rows)
        return self._run(token_ids, pos, row_ids, torch.full((rows,), slot)).view(rows, 1, self.vocab)

    def step_rows(self, tokens: Tensor, positions: Tensor, rows: Tensor, slots: Tensor) -> Tensor:
        """Logits [M, V] (fp32) for one token per input: input i is cache row rows[i], writes its K/V at
        slot slots[i] and attends over that row's valid slots up to it (mark the new slot valid first).
        All four are int64 [M] on the CPU; rows at different lengths share one call."""
        self._check_ids(tokens)
        return self._run(tokens.contiguous(), positions.contiguous(), rows.contiguous(), slots.contiguous())

    def run(self, tokens: Tensor, positions: Tensor, rows: Tensor, slots: Tensor, outs: Tensor) -> Tensor:
        """Logits [len(outs), V] (fp32) of the inputs `outs` (indices into the others) of one pass: input i is
        token tokens[i] of cache row rows[i] at slot slots[i] (marked valid first) and RoPE position
        positions[i]. Every input's K/V is stored before any attends, so the inputs of one row at consecutive
        slots form a causal chunk: one call prefills it (beside decode rows: one input each), and only the
        inputs in `outs` pay for the head."""
        self._check_ids(tokens)
        parts = (tokens, positions, rows, slots)
        return self._run(*(t.contiguous() for t in parts), outs=outs.contiguous())

    def _check_ids(self, token_ids: Tensor) -> None:
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab:
            raise IndexError(f"token ids must be in [0, {self.vocab})")

    def _run(
        self,
        tokens: Tensor,
        positions: Tensor,
        rows: Tensor,
        slots: Tensor,
        outs: Tensor | None = None,
    ) -> Tensor:
        """outs: the inputs whose logits are wanted (all, one per row, when None: a decode step)."""
        m = tokens.shape[0]
        need = m * self._per_row
        if self._work.numel() < need:
            self._work = torch.empty(need)  # work buffers, grown once to the largest pass seen
        logits = torch.empty(m if outs is None else outs.shape[0], self.vocab)
        clock = self.clock
        self.model_struct.layer_ns = clock.buffer.data_ptr() if clock is not None else None
        self._lib.forward_pass(
            ctypes.byref(self.model_struct),
            tokens.data_ptr(),
            positions.data_ptr(),
            rows.data_ptr(),
            slots.data_ptr(),
            m,
            self._work.data_ptr(),
            logits.data_ptr(),
            None if outs is None else outs.data_ptr(),
            -1 if outs is None else outs.shape[0],  # -1: logits of every input
        )
        fast = native.kernels()  # cached: the loaded build
        if fast is not None:
            fast.torch_follows_team()
        if clock is not None:  # the pass's rows and tokens per row, counted only while observing
            n_rows = m if outs is None else int(torch.unique(rows).numel())
            clock.record_fused(n_rows, m // n_rows)
        return logits


# Inputs per fused pass of a static prefill at most: the pass's work buffers (about 29 KB an input on SmolLM2)
# are kept for the model's next pass, so a 16 x 2048-token batch in one pass would hold ~1 GB for good. 512
# rows are past the point where the GEMMs gain from more (their activation chunks are L2-sized anyway).
MAX_PASS_INPUTS = 512


def native_static_prefill(
    fused: FusedDecoder, tokens: Tensor, positions: Tensor, cache: KVCache, valid: Tensor | None, *, logits: bool
) -> Tensor | None:
    """A prompt chunk [B, T] of a static batch (left padding marked False in `valid`) through the native
    pass, its K/V appended to `cache`. With `logits`, those of the chunk's last column [B, 1, V] (every row's
    last token: left padding), else None.

    The passes take only the real tokens (padding is never computed: its slots stay invalid, so no query
    sees them), at most MAX_PASS_INPUTS at a time (column by column: each piece sees the ones before it in
    the cache), and run the head on the last column alone."""
    batch, width = tokens.shape
    keep = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
    step = max(1, MAX_PASS_INPUTS // batch)
    found: Tensor | None = None
    for lo in range(0, width, step):
        hi = min(lo + step, width)
        last = logits and hi == width
        part = keep[:, lo:hi]
        start = cache.append(positions[:, lo:hi], None if valid is None else part)
        flat = part.reshape(-1)
        index = flat.nonzero().squeeze(1)  # the real tokens, row by row
        cols = hi - lo
        rows, at = index // cols, index % cols
        outs = torch.empty(0, dtype=torch.long)
        if last:  # each row's last column, as an index into the real tokens
            outs = flat.cumsum(0)[torch.arange(batch) * cols + cols - 1] - 1
        ids, pos = tokens[:, lo:hi].reshape(-1)[index], positions[:, lo:hi].reshape(-1)[index]
        if index.numel():
            found = fused.run(ids, pos, rows, start + at, outs)
    return found.view(batch, 1, fused.vocab) if logits and found is not None else None
