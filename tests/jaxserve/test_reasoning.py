"""Reasoning models (EngineArgs.reasoning_parser, jaxserve/reasoning.py): the <think> block told apart from the
answer, as a whole reply and as a stream, and structured outputs that wait for the answer.

The tiny random model does not think on its own, so the engine tests steer it with logit_bias: a large bias on
</think> makes it close the block at once, where its matcher has not masked anything yet; after that only the
grammar's tokens are allowed, so the reply is "</think>" and then the constraint's text."""

from __future__ import annotations

import itertools
import re

import jax
import numpy as np
import pytest
from engine_fixtures import small_engine_kwargs
from tiny_models import make_think_checkpoint, make_tiny_checkpoint

from jaxserve import LLM, SamplingParams
from jaxserve import reasoning as rs
from jaxserve.structured_output import GrammarCompiler, ReasoningGate, StructuredOutputsParams

R1, QWEN3 = rs.REASONING_PARSERS["deepseek_r1"], rs.REASONING_PARSERS["qwen3"]
START_ID, END_ID = 512, 513  # make_think_checkpoint's tags
REGEX = r"[a-z]{3,6}"
MESSAGES = [{"role": "user", "content": "Name a fruit."}]

REPLIES = [
    "<think>\nLet me see.\n</think>\n\nAn apple.",
    "Let me see.</think>An apple.",
    "An apple.",
    "<think>still thinking",
    "<think>cut at a tag's start </thi",
    "</think>",
    "<think></think>",
    "<thin",
    "",
]


@pytest.mark.parametrize("fmt, state", list(itertools.product([R1, QWEN3], [rs.UNDECIDED, rs.THINKING, rs.ANSWERING])))
def test_stream_deltas_join_to_the_whole_split(fmt, state):
    """Fed a character at a time (the worst case for tags cut across deltas), a stream sends exactly the whole
    reply's reasoning and answer, and never takes back what it sent."""
    for reply, size in itertools.product(REPLIES, (1, 3)):  # a character at a time, and three
        whole = rs.split(fmt, state, reply, final=True)
        stream = rs.ReasoningStream(fmt, state)
        pieces = [reply[i : i + size] for i in range(0, len(reply), size)] or [""]
        got = ["", ""]
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=i == len(pieces) - 1)
            got[0] += r
            got[1] += c
        assert got == [whole.reasoning or "", whole.content], (fmt.name, state, reply, size)


def test_where_the_reasoning_ends():
    assert rs.split(QWEN3, rs.UNDECIDED, REPLIES[0], True) == rs.Split("\nLet me see.\n", "\n\nAn apple.")
    assert rs.split(QWEN3, rs.UNDECIDED, "An apple.", True) == rs.Split(None, "An apple.")  # it answered at once
    assert rs.split(QWEN3, rs.THINKING, REPLIES[1], True) == rs.Split("Let me see.", "An apple.")
    assert rs.split(R1, rs.THINKING, "An apple.", True) == rs.Split("An apple.", "")  # cut while reasoning
    assert rs.split(QWEN3, rs.ANSWERING, REPLIES[0], True) == rs.Split(None, REPLIES[0])  # thinking was off
    assert rs.split(QWEN3, rs.UNDECIDED, "<thi", final=False) == rs.Split(None, "")  # held: may open a block


def test_the_prompt_decides_where_a_reply_starts():
    assert rs.prompt_state(QWEN3, "<|assistant|>\n<think>\n\n</think>\n\n") == rs.ANSWERING  # enable_thinking=False
    assert rs.prompt_state(QWEN3, "<|assistant|>\n<think>\n") == rs.THINKING
    assert rs.prompt_state(QWEN3, "<|assistant|>\n") == rs.UNDECIDED
    assert rs.prompt_state(R1, "<|assistant|>\n") == rs.THINKING  # R1 replies reason first, tag or not


@pytest.fixture(scope="module")
def think_path(tmp_path_factory):
    return str(make_think_checkpoint(tmp_path_factory.mktemp("think") / "model"))


def test_tags_must_be_single_tokens(tmp_path):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(make_tiny_checkpoint(tmp_path / "plain", "llama"))
    with pytest.raises(ValueError, match="needs '<think>' and '</think>' as single tokens"):
        rs.tag_token_ids(QWEN3, plain)
    with pytest.raises(ValueError, match="choose one of deepseek_r1, qwen3"):
        rs.reasoning_format("granite")


def test_the_gate_holds_the_matcher_until_the_answer(think_path):
    """A qwen3 reply left undecided: its first mask is the grammar's tokens plus <think>; while it thinks, no mask
    (every token allowed) and the matcher sees nothing; </think> hands the rest to the matcher."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(think_path)
    grammar = GrammarCompiler(tok, len(tok), (1,)).compile(StructuredOutputsParams(regex=REGEX))
    grammar.gate = ReasoningGate(rs.UNDECIDED, START_ID, END_ID)

    def allowed() -> set[int]:
        mask = np.full((1, grammar.words), -1, np.int32)
        grammar.fill(mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits[: len(tok)]).tolist())

    first = allowed()
    assert START_ID in first and END_ID not in first and len(first) < len(tok) // 2
    assert grammar.accept(START_ID) and grammar.gate.state == rs.THINKING
    assert allowed() == set(range(len(tok)))
    word = tok.encode("banana!!", add_special_tokens=False)  # not the regex's: the matcher must not see it
    assert all(grammar.accept(t) for t in word)
    assert grammar.accept(END_ID) and grammar.gate.state == rs.ANSWERING
    assert allowed() == first - {START_ID}  # the grammar from its start
    twin = grammar.copy()
    assert twin.gate is not grammar.gate and twin.gate.state == rs.ANSWERING


@pytest.fixture(scope="module")
def llm(think_path):
    return LLM(**small_engine_kwargs(model=think_path, reasoning_parser="qwen3"))


def _chat(llm, template_kwargs=None, n=1, bias=None, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=12, n=n, structured_outputs={"regex": REGEX},
                            logit_bias=bias, **kw)
    (out,) = llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs=template_kwargs)
    return [c.text for c in out.outputs]


def test_structured_outputs_wait_for_the_answer(llm):
    close = {END_ID: 100.0}
    # A block the prompt opened: unconstrained until </think>, which the bias picks at once; then the regex.
    for text in _chat(llm, {"open_think": True}, n=2, bias=close):
        assert text.startswith("</think>") and re.fullmatch(REGEX, text[len("</think>"):]), text
    # Thinking off (the prompt closed the block): the regex from the first token, the bias cannot reach </think>.
    (text,) = _chat(llm, {"enable_thinking": False}, bias=close)
    assert re.fullmatch(REGEX, text), text
    # Undecided: the first token may be <think> (the bias picks it), after which nothing is masked.
    (text,) = _chat(llm, bias={START_ID: 100.0})
    assert text.startswith("<think>") and not re.fullmatch(REGEX, text), text
    (text,) = _chat(llm)  # ... or the grammar's: an answer at once
    assert re.fullmatch(REGEX, text), text


def test_structured_outputs_in_reasoning_constrain_from_the_first_token(think_path):
    llm = LLM(**small_engine_kwargs(model=think_path, reasoning_parser="qwen3", structured_outputs_in_reasoning=True))
    (text,) = _chat(llm, {"open_think": True}, bias={END_ID: 100.0})
    assert re.fullmatch(REGEX, text), text


def test_engine_options_are_checked(think_path, tmp_path):
    with pytest.raises(ValueError, match="reasoning_parser='granite' is invalid: choose one of"):
        LLM(**small_engine_kwargs(model=think_path, reasoning_parser="granite"))
    with pytest.raises(ValueError, match="structured_outputs_in_reasoning=True is invalid: .*set reasoning_parser"):
        LLM(**small_engine_kwargs(model=think_path, structured_outputs_in_reasoning=True))
    plain = str(make_tiny_checkpoint(tmp_path / "plain", "llama"))
    with pytest.raises(ValueError, match="encodes '<think>' as"):
        LLM(**small_engine_kwargs(model=plain, reasoning_parser="deepseek_r1"))


def test_chat_template_kwargs_reach_the_template(llm):
    off = llm.apply_chat_template(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    on = llm.apply_chat_template(MESSAGES)
    assert off[-6:] != on[-6:] and START_ID in off and END_ID in off and START_ID not in on
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        llm.apply_chat_template(MESSAGES, chat_template_kwargs={"tokenize": False})


def _gated(llm, prompts: int = 3, n: int = 2) -> list[str]:
    """Replies to ``prompts`` conversations of different lengths, each in a block its prompt opened, closed at once by
    the bias: each must be "</think>" and then the regex's text."""
    conversations = [[{"role": "user", "content": "Name a fruit. " * (1 + 3 * i)}] for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=12, n=n, structured_outputs={"regex": REGEX},
                            logit_bias={END_ID: 100.0})
    outs = llm.chat(conversations, params, use_tqdm=False, chat_template_kwargs={"open_think": True})
    texts = [c.text for o in outs for c in o.outputs]
    for text in texts:
        assert text.startswith("</think>") and re.fullmatch(REGEX, text[len("</think>"):]), text
    return texts


def test_the_gate_through_chunked_prefill_prefix_caching_and_preemption(think_path):
    # Prompts of up to ~80 tokens over a 32-token budget, 20 blocks of 4 tokens for 6 samples: prefills are
    # chunked, samples are preempted and recomputed, and the second round reads the first's cached blocks.
    llm = LLM(**small_engine_kwargs(model=think_path, reasoning_parser="qwen3", num_gpu_blocks_override=40))
    first = _gated(llm)
    assert _gated(llm) == first
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_the_gate_under_tensor_and_data_parallelism(llm, think_path):
    reference = _gated(llm, prompts=2, n=1)
    tp = LLM(**small_engine_kwargs(model=think_path, reasoning_parser="qwen3", tensor_parallel_size=2))
    assert _gated(tp, prompts=2, n=1) == reference
    dp = LLM(**small_engine_kwargs(model=think_path, reasoning_parser="qwen3", data_parallel_size=2))
    try:
        assert _gated(dp, prompts=2, n=1) == reference
    finally:
        dp.llm_engine.close()


def test_bench_serve_counts_reasoning_as_output():
    """`jaxserve bench serve` times a reasoning model's first token from its first reasoning delta."""
    from jaxserve.bench.serve import _chunk_text

    assert _chunk_text({"choices": [{"delta": {"reasoning": "hm", "content": None}}]}, "chat") == "hm"
    assert _chunk_text({"choices": [{"delta": {"content": "ok"}}]}, "chat") == "ok"


def test_server_default_chat_template_kwargs(think_path):
    """--default-chat-template-kwargs: every chat request renders with them; a request's own override them."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from jaxserve.server.cli_args import parse_template_kwargs
    from jaxserve.server.protocol import ChatCompletionRequest
    from jaxserve.server.routes_chat import render_messages

    tok = AutoTokenizer.from_pretrained(think_path)
    state = SimpleNamespace(need_tokenizer=lambda what: tok,
                            default_chat_template_kwargs=parse_template_kwargs('{"enable_thinking": false}'))
    assert END_ID in render_messages(state, ChatCompletionRequest(messages=MESSAGES))
    asked = ChatCompletionRequest(messages=MESSAGES, chat_template_kwargs={"enable_thinking": True})
    assert END_ID not in render_messages(state, asked)
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_template_kwargs("[1]")
    with pytest.raises(ValueError, match="is not valid JSON"):
        parse_template_kwargs("{enable_thinking: false}")
