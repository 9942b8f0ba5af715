"""Incremental detokenization on real trained tokenizers: multi-byte characters and stop strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxserve import detokenizer as detokenizer_mod
from jaxserve.detokenizer import IncrementalDetokenizer, decode_token
from jaxserve.sampling_params import SamplingParams

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。今天天气很好。我们去公园散步吧。",
    "日本語のテキストも少し。カタカナとひらがな。",
    "Emoji time 😀🎉🚀 and a family 👩‍👩‍👧 with flags 🇫🇷🇯🇵.",
    "naïve café résumé — “quotes” and ellipsis…",
    "STOP here\n\nUser: next turn\n\nAssistant: ok",
]
TEXTS = [
    "Hello 你好 😀 world!",
    "🎉🚀👩‍👩‍👧 emoji soup 🇫🇷🇯🇵",
    "今天天气很好。naïve café résumé",
    "Rare: 𝄞 ⽕ 🦜 (never seen in training, so pure byte tokens)",
]


def _train(pre_tokenizer, decoder) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())


class DecodeOnly:
    """A tokenizer with no fast backend: forces the prefix / read-offset path."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def run(tokenizer, ids, params=None, prompt=()):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params or SamplingParams())
    deltas = [detok.update([t]) for t in ids]
    return detok, deltas


@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "prefix_offsets"])
def test_deltas_join_to_the_full_decode(byte_bpe, fast):
    tokenizer = byte_bpe if fast else DecodeOnly(byte_bpe)
    prompt = byte_bpe.encode("Emoji time", add_special_tokens=False)
    for text in TEXTS:
        ids = byte_bpe.encode(text, add_special_tokens=False)
        assert any(byte_bpe.decode([t]).endswith("\ufffd") for t in ids), "test needs split characters"
        detok, deltas = run(tokenizer, ids + [byte_bpe.eos_token_id], prompt=prompt)
        for n, delta in enumerate(deltas):
            assert "\ufffd" not in delta
            # Token by token, text is held back only while a character is unfinished.
            so_far, streamed = byte_bpe.decode(ids[: n + 1]), "".join(deltas[: n + 1])
            assert so_far.startswith(streamed)
            assert so_far == streamed or "\ufffd" in so_far[len(streamed) :]
        assert "".join(deltas) == detok.output_text == byte_bpe.decode(ids, skip_special_tokens=True)


def test_special_tokens_kept_when_asked(byte_bpe):
    ids = byte_bpe.encode("Hello", add_special_tokens=False) + [byte_bpe.eos_token_id]
    detok, _ = run(byte_bpe, ids, SamplingParams(skip_special_tokens=False))
    assert detok.output_text == "Hello</s>"


def test_metaspace_tokenizer_keeps_the_space_after_the_prompt():
    # SentencePiece-style: spaces are "▁" and the decoder strips the text's leading space.
    tokenizer = _train(pre_tokenizers.Metaspace(), decoders.Metaspace())
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    out = tokenizer.encode("Hello world 你好", add_special_tokens=False)[len(prompt) :]
    detok, deltas = run(tokenizer, out, prompt=prompt)
    full = tokenizer.decode(prompt + out)
    assert detok.output_text == full[len(tokenizer.decode(prompt)) :] == " world 你好"


def test_stop_string_cuts_exactly(byte_bpe):
    ids = byte_bpe.encode("Hello world! The quick brown fox", add_special_tokens=False)
    detok, deltas = run(byte_bpe, ids, SamplingParams(stop=["quick"]))
    assert detok.output_text == "".join(deltas) == "Hello world! The "
    assert detok.stop_string == "quick" and detok.stopped
    assert detok.update(ids[:3]) == "" and detok.output_text == "Hello world! The "

    detok, deltas = run(byte_bpe, ids, SamplingParams(stop=["quick"], include_stop_str_in_output=True))
    assert detok.output_text == "".join(deltas) == "Hello world! The quick"


def test_stop_string_split_across_tokens_never_leaks(byte_bpe):
    text = "STOP here\n\nUser: next turn"
    ids = byte_bpe.encode(text, add_special_tokens=False)
    stop = "\n\nUser:"
    assert not any(stop in byte_bpe.decode([t]) for t in ids), "the stop string must span tokens"
    detok, deltas = run(byte_bpe, ids, SamplingParams(stop=[stop]))
    assert detok.output_text == "".join(deltas) == "STOP here"
    assert all("\n" not in d for d in deltas)


def test_stop_string_inside_a_multibyte_character_run(byte_bpe):
    ids = byte_bpe.encode("天气很好😀🎉 after", add_special_tokens=False)
    for include, want in [(False, "天气很好"), (True, "天气很好😀🎉")]:
        detok, deltas = run(byte_bpe, ids, SamplingParams(stop=["😀🎉"], include_stop_str_in_output=include))
        assert detok.output_text == "".join(deltas) == want


def test_first_completed_stop_string_wins(byte_bpe):
    ids = byte_bpe.encode("Hello world! The quick brown fox", add_special_tokens=False)
    detok, _ = run(byte_bpe, ids, SamplingParams(stop=["brown", "world!", "o w"]))
    assert detok.stop_string == "o w" and detok.output_text == "Hell"


def test_finish_releases_held_back_text(byte_bpe):
    ids = byte_bpe.encode("Hello world\n\nUs", add_special_tokens=False)
    detok, deltas = run(byte_bpe, ids, SamplingParams(stop=["\n\nUser:"]))
    assert "".join(deltas) == "Hello world"  # "\n\nUs" could still become the stop string
    assert detok.finish() == "\n\nUs" and detok.output_text == "Hello world\n\nUs" and not detok.stopped


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Cut at the stop string whose first occurrence ends first (the longer one on a tie)."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, neg_len, stop = min(found)
    return text[: end if include else end + neg_len], stop


def test_random_streams_match_a_whole_text_reference(byte_bpe):
    rng = random.Random(0)
    alphabet = list("ab c\n你好😀") + ["🎉", "é"]
    for trial in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.3
        ids = byte_bpe.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams(stop=stops, include_stop_str_in_output=include))
        want, want_stop = _reference(byte_bpe.decode(ids), stops, include)
        streamed = ""
        for t in ids:
            streamed += detok.update([t])
            assert want.startswith(streamed), (text, stops, streamed, want)  # nothing is ever taken back
        if not detok.stopped:
            streamed += detok.finish()
        assert (streamed, detok.stop_string) == (want, want_stop), (text, stops, include)
        assert detok.output_text == streamed


def test_decode_token(byte_bpe):
    ids = byte_bpe.encode("Hello 😀", add_special_tokens=False)
    assert [decode_token(byte_bpe, t) for t in ids] == [byte_bpe.decode([t]) for t in ids]
    assert any("\ufffd" in decode_token(byte_bpe, t) for t in ids)  # a piece of the emoji
    assert decode_token(byte_bpe, byte_bpe.eos_token_id) == "</s>"  # special tokens are shown


def test_decode_stream_failure_falls_back_without_losing_text(byte_bpe, monkeypatch):
    real = detokenizer_mod.DecodeStream

    class Flaky:
        """DecodeStream that fails on its 9th step, as it does for some decoders."""

        def __init__(self, **kwargs):
            self._inner, self._calls = real(**kwargs), 0

        def step(self, tokenizer, token_id):
            self._calls += 1
            if self._calls == 9:
                raise Exception("Invalid prefix encountered")
            return self._inner.step(tokenizer, token_id)

    monkeypatch.setattr(detokenizer_mod, "DecodeStream", Flaky)
    prompt = byte_bpe.encode("Emoji", add_special_tokens=False)
    for text in TEXTS:
        ids = byte_bpe.encode(text, add_special_tokens=False)
        detok, deltas = run(byte_bpe, ids, prompt=prompt)
        assert "".join(deltas) == byte_bpe.decode(ids) and not any("\ufffd" in d for d in deltas)
