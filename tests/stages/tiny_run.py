"""A tiny Llama with a tiny byte-level BPE tokenizer, and a plan that runs it end to end in-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.llm.tiny import make_tiny_llama

SENTENCES = [
    "A language model turns a prompt into text, one token at a time.",
    "The cache keeps keys and values so each new token is cheap.",
    "注意力机制 看 每个 词。 言語モデルは文章を作ります。",
    "Hello world, hello model, hello tokens and layers.",
]
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_byte_bpe(out: Path, corpus: list[str], specials: list[str], config: dict[str, Any]) -> int:
    """Train a 420-entry byte-level BPE on `corpus` into `out` (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tok.get_vocab_size()


def make_tokenizer(out: Path) -> int:
    """Train a byte-level BPE (ids 0/1/2 = pad/bos/eos, as the tiny model's config) into `out`; return its size."""
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}
    return train_byte_bpe(out, SENTENCES * 4 + SENTENCES[2:3] * 20, SPECIALS, config)


def make_tiny_model_dir(tmp_path: Path, n_layers: int = 3) -> tuple[Path, Any]:
    """An HF-format tiny Llama directory with a tokenizer; returns (dir, the transformers model)."""
    probe = tmp_path / "tok-probe"
    vocab = make_tokenizer(probe)
    model_dir, hf = make_tiny_llama(tmp_path, n_layers=n_layers, vocab=vocab, hidden=64, heads=4, kv_heads=2)
    make_tokenizer(model_dir)
    return model_dir, hf


def load_stages(
    model_dir: Path, *, hashes: str = "off", place: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The load half of a tiny plan, env to place (fp32; no hashes and a 128-token cache unless told)."""
    return [
        {"id": "env", "uses": "env.check"},
        {"id": "model", "uses": "model.source", "with": {"path": str(model_dir)}},
        {"id": "config", "uses": "load.config"},
        {"id": "tokenizer", "uses": "load.tokenizer"},
        {"id": "verify", "uses": "load.verify", "with": {"hashes": hashes}},
        {"id": "read", "uses": "load.shard_stream"},
        {"id": "convert", "uses": "load.convert", "with": {"dtype": "fp32"}},
        {"id": "place", "uses": "load.to_device", "with": place or {"kv_cache": {"max_tokens": 128}}},
    ]


def write_plan(
    tmp_path: Path,
    model_dir: Path,
    *,
    observe: dict[str, Any] | None = None,
    prompt: str = "Hello model, 注意力 and tokens.",
    generate: dict[str, Any] | None = None,
    name: str = "tiny",
) -> Path:
    plan: dict[str, Any] = {
        "name": name,
        "device": "cpu",
        "seed": 0,
        "threads": 1,
        "observe": {"memory_interval_ms": 5, **(observe or {})},
        "stages": [
            *load_stages(model_dir),
            {"id": "prompt", "uses": "compute.tokenize", "with": {"messages": [{"role": "user", "content": prompt}]}},
            {
                "id": "generate",
                "uses": "compute.generate",
                "with": {
                    "max_new_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": False,
                    **(generate or {}),
                },
            },
        ],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def run_plan(plan: Path, out: Path) -> Path:
    from llmplan.engine.cli import main

    code = main(["run", str(plan), "--out", str(out), "--quiet"])
    assert code == 0, (out / "run.json").read_text() if (out / "run.json").exists() else code
    return out


def wire_observers(monkeypatch: Any) -> bool:
    """Until load.to_device / compute.generate call the observe functions themselves, wrap them so
    they do (exactly the one-line calls the wiring adds). Returns whether a shim was needed."""
    import inspect

    from llmplan.stages import compute_generate, load_to_device, observe

    shimmed = False
    if "begin_observing" not in inspect.getsource(load_to_device):
        place = load_to_device.ToDevice.run

        def place_run(self: Any, ctx: Any, params: Any) -> None:
            place(self, ctx, params)
            observe.begin_observing(ctx, ctx.model, ctx.kv_cache)

        monkeypatch.setattr(load_to_device.ToDevice, "run", place_run)
        shimmed = True
    if "finish_observing" not in inspect.getsource(compute_generate):
        generate = compute_generate.Generate.run

        def generate_run(self: Any, ctx: Any, params: Any) -> None:
            generate(self, ctx, params)
            observe.finish_observing(ctx, ctx.generations)

        monkeypatch.setattr(compute_generate.Generate, "run", generate_run)
        shimmed = True
    return shimmed
