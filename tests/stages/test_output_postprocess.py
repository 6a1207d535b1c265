from __future__ import annotations

from structlog.testing import capture_logs

from llmplan.stages.output_detokenize import OutputDetokenize
from llmplan.stages.output_postprocess import OutputPostprocess, PostprocessParams
from llmplan.stages.types import Candidate


def _run(ctx, gens, **params):
    ctx.generations = gens
    OutputPostprocess().run(ctx, PostprocessParams(**params))
    return ctx.answers


def _text(tok, ids):
    return tok.decode(ids)


def test_specials_and_template_tokens_are_dropped(ctx, tokenizer, gen):
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    body = tokenizer.encode("Hello world.")
    g = gen(tokenizer, "a", "x")
    tok = tokenizer
    g.generation.tokens = [tok.bos_id, start, *body, end, tok.pad_id, tok.eos_id, *tok.encode("after")]
    (answer,) = _run(ctx, [g])
    assert answer.ids == body  # everything after EOS is gone, specials anywhere are gone
    assert answer.dropped_invalid == []


def test_invalid_ids_are_dropped_with_a_warning(ctx, tokenizer, gen):
    body = tokenizer.encode("Hello world.")
    g = gen(tokenizer, "a", "x", finish="length")
    g.generation.tokens = [*body[:2], -1, tokenizer.vocab_size, *body[2:], 10**9]
    g.candidates = [Candidate([*body, tokenizer.vocab_size + 7], -1.0, "length")]
    with capture_logs() as logs:
        (answer,) = _run(ctx, [g])
    assert answer.ids == body
    assert answer.candidate_ids == [body]
    assert answer.dropped_invalid == [-1, tokenizer.vocab_size, 10**9, tokenizer.vocab_size + 7]
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert warnings and warnings[0]["event"] == "invalid_token_ids" and warnings[0]["request"] == "a"
    assert ctx.metrics.get("run", "invalid_ids") == 4


def test_trim_to_sentence_only_for_length(ctx, tokenizer, gen):
    cut = gen(tokenizer, "cut", "The sky is blue. The grass is gre", finish="length")
    eos = gen(tokenizer, "eos", "The sky is blue. The grass is gre")
    answers = _run(ctx, [cut, eos], trim_to_sentence=True)
    assert _text(tokenizer, answers[0].ids) == "The sky is blue."
    assert _text(tokenizer, answers[1].ids) == "The sky is blue. The grass is gre"
    # and off by default
    (untrimmed,) = _run(ctx, [gen(tokenizer, "c", "The sky is blue. The grass is gre", finish="length")])
    assert _text(tokenizer, untrimmed.ids) == "The sky is blue. The grass is gre"


def test_trim_to_sentence_cjk_exclamation_and_no_end(ctx, tokenizer, gen):
    cases = {
        "天空是蓝色的。草是绿": "天空是蓝色的。",
        "Is it? Yes, it is! And then the": "Is it? Yes, it is!",
        "pi is 3.14 and e is 2.71 and so": "pi is 3.14 and e is 2.71 and so",  # no sentence end: kept whole
        "Hello world.": "Hello world.",  # already complete
    }
    gens = [gen(tokenizer, str(i), text, finish="length") for i, text in enumerate(cases)]
    answers = _run(ctx, gens, trim_to_sentence=True)
    assert [_text(tokenizer, a.ids) for a in answers] == list(cases.values())


def test_trim_keeps_the_answer_and_detokenized_text_consistent(ctx, tokenizer, gen, req):
    g = gen(tokenizer, "a", "Hello world. Hello there, cla", finish="length")
    ctx.requests = [req(tokenizer, "a", "prompt")]
    _run(ctx, [g], trim_to_sentence=True)
    OutputDetokenize().run(ctx, None)
    (completion,) = ctx.completions
    assert completion.text == "Hello world."
    assert completion.tokens == g.tokens  # the generated ids as produced, for usage and logprobs
    assert completion.completion_tokens == len(g.tokens)


def test_length_cut_inside_an_emoji_leaves_no_replacement_char(ctx, tokenizer, gen):
    full = tokenizer.encode("more 🦄")  # not in the training corpus: one byte token per UTF-8 byte
    assert tokenizer.decode(full[:-1]).endswith("\ufffd"), "the test needs an emoji spread over byte tokens"
    g = gen(tokenizer, "a", "x", finish="length")
    g.generation.tokens = full[:-1]  # cut in the middle of the emoji's bytes
    (answer,) = _run(ctx, [g])
    text = _text(tokenizer, answer.ids)
    assert "\ufffd" not in text and text.rstrip() == "more"  # the space may share a token with the first byte
    g.generation.tokens = full  # complete: untouched
    (answer,) = _run(ctx, [g])
    assert _text(tokenizer, answer.ids) == "more 🦄"


def test_beam_candidates_cleaned_the_same_way(ctx, tokenizer, gen):
    eos = tokenizer.eos_id
    a, b = tokenizer.encode("The sky is blue."), tokenizer.encode("The grass is green!")
    g = gen(tokenizer, "beam", "The sky is blue.")
    g.candidates = [Candidate([*a, eos], -1.5, "eos"), Candidate([tokenizer.bos_id, *b, eos, eos], -2.5, "eos")]
    (answer,) = _run(ctx, [g])
    assert answer.candidate_ids == [a, b]
