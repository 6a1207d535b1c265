"""The GGUF import of three real models, against transformers loading the very same files (slow; run alone).

Opt-in (`make test-real`, which fetches the files through the plans first): runs when LLMPLAN_REAL_MODELS=1,
on the joined files in `LLMPLAN_REAL_GGUF_DIR` or where the plans' `pieces:` source left them in the model cache
($LLMPLAN_CACHE/downloads/<sha256[:16]>/<name>), i.e.
gemma-3-270m-q4_k_m.gguf (gemma3, SentencePiece 262,144 tokens) and
qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (qwen2, byte-level BPE 151,936 tokens, qwen2 pre-split) and
qwen2.5-coder-1.5b-instruct-q4_k_m.gguf (the same family and vocabulary at 1.5B, with its own output matrix);
each is checked against its SHA-256 first. For each model:

* fp32 logits of the import (llmplan's torch model) and of transformers' GGUF loader, at every position of
  16 prompts with 32 greedy tokens each: max |delta| within LOGIT_TOLERANCE. Both dequantize with gguf-py,
  so only the summation order differs; the tolerance is set from the measured figures
  (benchmarks/real-models.md) with room for other CPUs' kernels, far below what a mis-mapped tensor moves;
* greedy: at every step of transformers' greedy path, llmplan's argmax is transformers' token, unless
  transformers' top-two margin there is under TIE_MARGIN (a tie: printed, and that prompt ends there);
* both checks again on the backend `llmplan run` takes on a CPU, the fused native pass (fp32 weights and K/V):
  prompt and the path's first tokens as one chunk (its attention in blocks), the rest a decode step each;
* the tokenizer: llmplan's encode (BOS as the file says) and decode equal transformers' on 300+ strings
  (CJK, emoji, code, whitespace runs, the special tokens as text).

Figures are printed (`pytest -s`) for benchmarks/real-models.md.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny import load_tiny
from torch import Tensor

from llmplan.cache_home import cache_home
from llmplan.llm.formats.gguf import import_gguf
from llmplan.llm.generation import ModelRunner
from llmplan.llm.generation.flat_batch import FlatBatch, Part
from llmplan.llm.kernels import native
from llmplan.llm.kv import SlotCache
from llmplan.llm.text import Tokenizer
from llmplan.stages.model_source import default_cache_dir

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

REAL_DIR = os.environ.get("LLMPLAN_REAL_GGUF_DIR")
if os.environ.get("LLMPLAN_REAL_MODELS") != "1":
    pytest.skip(
        "real-model checks are opt-in: make test-real (about 15 minutes on 2 cores once fetched)",
        allow_module_level=True,
    )
MODELS = {
    "gemma-3-270m-q4_k_m.gguf": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
}
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<tool_call>",
]
SPECIALS = {
    "gemma-3-270m-q4_k_m.gguf": ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<mask>"],
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": QWEN_SPECIALS,
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": QWEN_SPECIALS,
}
LOGIT_TOLERANCE = 5e-3  # measured: 0 (Gemma), 1.6e-3 (Qwen); see benchmarks/real-models.md
TIE_MARGIN = 2 * LOGIT_TOLERANCE
NEW_TOKENS = 32
PREFIX_PATH = 16  # path tokens in the native test's first chunk: 17+ inputs attend in blocks
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "東京は日本の首都で、",
    "List three prime numbers: 2, 3,",
    "import numpy as np\n\nx = np.",
    "The quick brown fox",
    "Water boils at a temperature of",
    "SELECT name FROM users WHERE",
    "In 1969, the first humans",
    "// A function that reverses a string\nfunction reverse(s) {",
    "Les chats sont des animaux",
    "The three laws of thermodynamics are",
    "<html>\n  <body>\n    <h1>",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8, 13,",
]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="module", params=list(MODELS))
def real(request: pytest.FixtureRequest) -> dict[str, Any]:
    name = request.param
    places = [Path(REAL_DIR) / name] if REAL_DIR else []
    places.append(cache_home() / "downloads" / MODELS[name][:16] / name)
    path = next((p for p in places if p.is_file()), places[-1])
    if not path.is_file():
        pytest.skip(f"{path} is not there (make test-real fetches it; or set LLMPLAN_REAL_GGUF_DIR)")
    assert _sha256(path) == MODELS[name], f"{path}: not the pinned file"
    # the model cache the plans import into: `make test-real` has just imported these files there, and a
    # finished import is only read (7.1 GB and a minute for the 1.5B model, not done again)
    out = import_gguf(path, default_cache_dir())
    return {"name": name, "path": path, "dir": out}


def _theirs(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    ).eval()


def _greedy(hf: Any, ids: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy path (its own KV cache) and the top-two margin at each step."""
    tokens: list[int] = []
    margins: list[float] = []
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(NEW_TOKENS):
            top = out.logits[0, -1].topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            step = torch.tensor([[tokens[-1]]])
            if hasattr(out, "cache"):  # transformers 5 renamed past_key_values (the old name goes in 5.40)
                out = hf(step, cache=out.cache, use_cache=True)
            else:
                out = hf(step, past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


@pytest.fixture(scope="module")
def theirs(real: dict[str, Any]) -> list[dict[str, Any]]:
    """transformers' side of each prompt, computed once for both backends: its greedy path, the top-two margin
    at each step, and its fp32 logits at every position of prompt + path."""
    tok = Tokenizer.from_dir(real["dir"])
    hf = _theirs(real["path"])
    cases = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        path, margins = _greedy(hf, ids)
        with torch.no_grad():
            want = hf(torch.tensor([ids + path])).logits[0]
        cases.append({"prompt": prompt, "ids": ids, "path": path, "margins": margins, "want": want})
    return cases


def _compare(name: str, backend: str, cases: list[dict[str, Any]], ours: list[Tensor]) -> None:
    """Our logits at every position of each case against transformers': the worst |delta|, and our argmax at
    each step of transformers' greedy path (a differing pick must be a tie, which ends that prompt)."""
    worst = 0.0
    ties: list[str] = []
    agreed = 0
    for case, got in zip(cases, ours, strict=True):
        ids, path, margins = case["ids"], case["path"], case["margins"]
        worst = max(worst, (got - case["want"]).abs().max().item())
        picks = got[len(ids) - 1 : -1].argmax(-1).tolist()  # our choice at each step of transformers' path
        for step, (mine, theirs, margin) in enumerate(zip(picks, path, margins, strict=True)):
            if mine != theirs:
                assert margin < TIE_MARGIN, f"{case['prompt']!r} step {step}: {mine} != {theirs}, margin {margin:.4f}"
                ties.append(f"{case['prompt']!r} step {step}: margin {margin:.5f} ({mine} vs {theirs})")
                break
            agreed += 1
    print(f"\n{name} ({backend}): max |delta logit| {worst:.2e} over {len(cases)} prompts x (prompt + {NEW_TOKENS})")
    print(f"{name} ({backend}): greedy steps identical {agreed}/{len(cases) * NEW_TOKENS}; ties: {ties or 'none'}")
    assert worst <= LOGIT_TOLERANCE


def test_logits_and_greedy_equal_transformers(real: dict[str, Any], theirs: list[dict[str, Any]]) -> None:
    """The torch modules (llm/model/transformer.py) over each whole sequence at once."""
    model = load_tiny(real["dir"])
    ours = []
    for case in theirs:
        seq = torch.tensor([case["ids"] + case["path"]])
        with torch.no_grad():
            ours.append(model(seq, torch.arange(seq.shape[1])[None])[0])
    _compare(real["name"], "torch modules", theirs, ours)


@pytest.mark.skipif(native.kernels() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")
def test_the_native_pass_equals_transformers(real: dict[str, Any], theirs: list[dict[str, Any]]) -> None:
    """The backend `llmplan run` takes on a CPU (the fused native pass, fp32 weights and K/V): the prompt and the
    first PREFIX_PATH tokens of the path as one chunk, every input's logits (the chunk's attention in blocks),
    then the rest of the path a token a pass, as decode steps feed it (the one-input attention)."""
    model = load_tiny(real["dir"])
    ours = []
    for case in theirs:
        seq = case["ids"] + case["path"]
        cache = SlotCache.for_model(model, 1, len(seq), chunk=len(seq))
        runner = ModelRunner(model, cache)
        assert runner.backend == "native"
        head = len(case["ids"]) + PREFIX_PATH
        parts = [Part(0, 0, seq[:head], head)] + [Part(0, at, [seq[at]], True) for at in range(head, len(seq))]
        rows = []
        with torch.inference_mode():
            for part in parts:
                cache.claim([part.row], [part.tokens])
                rows.append(runner.forward(FlatBatch([part]), cache))
        ours.append(torch.cat(rows))
    _compare(real["name"], "native pass", theirs, ours)


def _strings(specials: list[str], seed: int = 0) -> list[str]:
    base = [
        "Hello, world!",
        "日本語のテキストを分割する",
        "中文分词测试，标点符号。",
        "한국어 문장입니다",
        "emoji 😀👍🏽🇫🇷👨‍👩‍👧 mixed",
        "def f(x):\n    return x ** 2  # square\n",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        '{"key": [1, 2.5, null, true], "k2": "v"}',
        "    indented\n\tand tabbed\n\n\n",
        "trailing spaces   ",
        "   leading",
        "a  b   c    d     e",
        "\n\n\n\n",
        "\r\n windows \r\n",
        "numbers 1234567890 3.14159 -42 1e-10",
        "Ünïcödé àccents ñ ß ẞ ﬁ ligature",
        "zero\u200bwidth\u00a0nbsp",
        "URL https://example.com/path?q=1&r=2#frag",
        "mixed日本English中文한국어",
        "x" * 40,
        "The quick brown fox jumps over the lazy dog.",
        "can't won't I'm you're it's",
        "<html><body class='x'>text</body></html>",
        "$ ls -la | grep '^d' > out.txt",
        "ΑΒΓ αβγ Ωμέγα",
        "Привет, мир!",
        "مرحبا بالعالم",
        "∑ ∫ √ ∞ ≠ ≤ ≥",
        "",
        " ",
        *specials,
        *(f"before {s} after" for s in specials),
        "".join(specials),
    ]
    wrapped = [f"{pre}{text}{post}" for text in base for pre, post in (("", ""), (" ", ""), ("", "\n"), ("\t", "  "))]
    rng = np.random.default_rng(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyz",
        "ABCXYZ0123456789",
        " \t\n",
        ".,;:!?()[]{}<>'\"-_/\\|@#$%^&*+=~`",
        "日本語中文字한국",
        "😀👍🏽🚀✨🇯🇵",
        "éèêëàâäôöûüçñß",
    ]
    chars = "".join(pools)
    randoms = ["".join(rng.choice(list(chars), size=int(rng.integers(1, 40)))) for _ in range(160)]
    return wrapped + randoms


def test_tokenizer_equals_transformers(real: dict[str, Any]) -> None:
    ours = Tokenizer.from_dir(real["dir"])
    theirs = transformers.AutoTokenizer.from_pretrained(real["path"].parent, gguf_file=real["path"].name)
    strings = _strings(SPECIALS[real["name"]])
    assert len(strings) >= 300
    differ = []
    for text in strings:
        ids = ours.encode(text)
        if ids != theirs(text).input_ids or ours.decode(ids) != theirs.decode(ids, skip_special_tokens=False):
            differ.append(text)
    print(f"\n{real['name']}: tokenizer equal on {len(strings) - len(differ)}/{len(strings)} strings")
    assert differ == []
