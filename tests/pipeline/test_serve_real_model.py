"""`llmplan serve` on the bundled SmolLM2 in fp32: concurrent greedy answers equal the same requests alone.

fp32 and greedy, so each request's tokens depend only on its prompt: 8 clients streaming at once on 4
slots (rows at different lengths sharing decode steps, requests joining as others leave, the system
prompt's K/V copied between slots) must produce exactly the texts they get one at a time.
"""

from __future__ import annotations

import threading
from pathlib import Path

import openai

from llmplan.commands.serve.app import ServerSettings
from tests.commands.conftest import LiveServer

from .conftest import PLANS

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish.",
    "What's 17 + 25?",
    "Give me a name for a pet llama.",
    "Explain recursion in one sentence.",
    "Name two colors of the rainbow.",
]


def test_eight_concurrent_clients_equal_one_at_a_time(tmp_path: Path, smollm2_dir: Path) -> None:
    overrides = [
        "place.max_batch=4",
        "place.kv_cache.max_tokens=256",
        "generate.max_new_tokens=24",
        "lookup.mode=off",
        f"store.db={tmp_path / 'results.sqlite'}",
        "write.to=[terminal]",
    ]
    with LiveServer(PLANS / "llama-fp32.yaml", ServerSettings(), overrides, tmp_path / "run") as live:
        client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=120)

        def ask(question: str, stream: bool) -> str:
            messages = [{"role": "user", "content": question}]
            # greedy asked for: a served request's omitted temperature is OpenAI's 1, not the plan's 0
            greedy = {"model": "llama-fp32", "messages": messages, "temperature": 0}
            if not stream:
                return client.chat.completions.create(**greedy).choices[0].message.content
            parts = client.chat.completions.create(**greedy, stream=True)
            return "".join(p.choices[0].delta.content or "" for p in parts if p.choices)

        alone = [ask(q, stream=False) for q in QUESTIONS]
        together: dict[int, str] = {}
        threads = [
            threading.Thread(target=lambda i=i: together.__setitem__(i, ask(QUESTIONS[i], True))) for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [together.get(i) for i in range(8)] == alone
        assert "Paris" in alone[0]
        stats = live.host.scheduler.stats
        assert stats.busy_max == 4 and stats.reused_tokens > 0
