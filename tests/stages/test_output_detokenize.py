from __future__ import annotations

import pytest

from llmplan.llm.text.tokenizer import StreamDecoder
from llmplan.stages.output_detokenize import OutputDetokenize
from llmplan.stages.output_postprocess import OutputPostprocess, PostprocessParams
from llmplan.stages.types import Candidate

ROUND_TRIPS = [
    "  leading spaces\n\ttabs and\nnew lines\n\n",
    "日本語のテキスト。天空是蓝色的。",
    "emoji 🎉👍🏽😀 and a unicorn 🦄 (not in the vocabulary)",
    " one leading space",
    "mixed: Hello 你好 🚀\nnext line",
]


def _complete(ctx, gens, requests):
    ctx.generations, ctx.requests = gens, requests
    OutputPostprocess().run(ctx, PostprocessParams())
    OutputDetokenize().run(ctx, None)
    return ctx.completions


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_round_trip_is_exact(ctx, tokenizer, gen, req, text):
    (completion,) = _complete(ctx, [gen(tokenizer, "a", text)], [req(tokenizer, "a", "p")])
    assert completion.text == text
    # The whole-sequence decode agrees with what a stream showed token by token.
    stream = StreamDecoder(tokenizer)
    streamed = "".join(stream.push(i) for i in tokenizer.encode(text)) + stream.flush()
    assert streamed == completion.text


def test_completion_fields(ctx, tokenizer, gen, req):
    g = gen(
        tokenizer,
        "a",
        "Hello world.",
        logprobs=[-0.1] * 4,
        prompt_tokens=7,
        ttft_s=0.02,
        prefill_s=0.01,
        decode_s=0.06,
        batch_prompt=7,
        from_cache=True,
        streamed=True,
    )
    (c,) = _complete(ctx, [g], [req(tokenizer, "a", "Say hello")])
    assert c.request_id == "a" and c.prompt == "Say hello" and (c.finish_reason, c.finish_detail) == ("stop", "eos")
    assert c.prompt_tokens == 7 and c.completion_tokens == len(g.tokens) and c.tokens == g.tokens
    assert c.logprobs == [-0.1] * 4
    assert c.generation is g.generation  # shared, never copied: the timings stay typed until a sink writes them
    decoded = len(g.tokens) - 1
    assert c.timings == {
        "queue_s": 0.0,
        "prefill_s": 0.01,
        "ttft_s": 0.02,
        "decode_s": 0.06,
        "prefill_tokens_per_s": 7 / 0.01,
        "decode_tokens_per_s": decoded / 0.06,
        "batch": 1.0,
    }
    assert c.from_cache and c.streamed and c.error is None


def test_beam_candidates_have_text_tokens_and_scores(ctx, tokenizer, gen, req):
    eos = tokenizer.eos_id
    g = gen(tokenizer, "b", "The sky is blue.")
    g.candidates = [
        Candidate([*tokenizer.encode("The sky is blue."), eos], -1.25, "eos"),
        Candidate([*tokenizer.encode("The grass is green!"), eos], -2.5, "eos"),
        Candidate(tokenizer.encode("Is it"), -3.0, "length"),
    ]
    (c,) = _complete(ctx, [g], [req(tokenizer, "b", "p")])
    assert c.candidate_texts == ["The sky is blue.", "The grass is green!", "Is it"]
    assert [x.score for x in c.candidates] == [-1.25, -2.5, -3.0]
    assert c.candidates[0].tokens == g.candidates[0].tokens
    assert c.candidates[2].finish_reason == "length"


def test_error_generation_is_carried(ctx, tokenizer, gen, req):
    g = gen(tokenizer, "e", "partial", finish="error", error="non-finite logits")
    (c,) = _complete(ctx, [g], [req(tokenizer, "e", "p")])
    assert c.finish_reason == "error" and c.error == "non-finite logits" and c.text == "partial"


def test_stop_string_is_not_part_of_the_text(ctx, tokenizer, gen, req):
    g = gen(tokenizer, "s", "The sky is blue. The grass is", finish="stop_string", params={"stop": ["Is it", "grass"]})
    (c,) = _complete(ctx, [g], [req(tokenizer, "s", "p")])
    assert c.text == "The sky is blue. The " and c.finish_detail == "stop_string"
    assert c.tokens == g.tokens  # the ids stay what the model generated
    plain = gen(tokenizer, "l", "The grass is green", finish="length", params={"stop": ["grass"]})
    (c,) = _complete(ctx, [plain], [req(tokenizer, "l", "p")])
    assert c.text == "The grass is green"  # only a sequence a stop string ended is cut


def test_top_logprobs_reach_the_result(ctx, tokenizer, gen, req):
    from llmplan.stages.completion_rendering import result_object

    g = gen(tokenizer, "t", "The sky", finish="length")
    g.generation.logprobs = [-0.1 * (i + 1) for i in range(len(g.tokens))]
    g.generation.top_logprobs = [[(t, lp), (t + 1, lp - 1.0)] for t, lp in zip(g.tokens, g.logprobs, strict=True)]
    g.top_n = 2
    (c,) = _complete(ctx, [g], [req(tokenizer, "t", "p")])
    entries = result_object(c)["token_logprobs"]
    assert [e["id"] for e in entries] == g.tokens
    assert "".join(e["token"] for e in entries) == "The sky"
    assert [e["logprob"] for e in entries] == g.logprobs
    assert [[a["id"] for a in e["top_logprobs"]] for e in entries] == [[t, t + 1] for t in g.tokens]
    assert entries[0]["top_logprobs"][1] == {
        "token": tokenizer.decode([g.tokens[0] + 1]),
        "id": g.tokens[0] + 1,
        "logprob": g.logprobs[0] - 1.0,
    }
    (plain,) = _complete(ctx, [gen(tokenizer, "u", "The sky", finish="length")], [req(tokenizer, "u", "p")])
    assert result_object(plain)["token_logprobs"] is None
