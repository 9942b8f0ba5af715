"""A transformers tokenizer built from a GGUF file's metadata, without torch.

transformers can read a GGUF tokenizer itself, but that path imports torch, which jaxserve never does at
run time. So the ``tokenizers`` pipeline is assembled here (see ``gguf_vocab``) and wrapped in a
``PreTrainedTokenizerFast``, which brings encode/decode, special-token handling and chat templates.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
from tokenizers import AddedToken, Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from jaxserve.models.loader.gguf import open_gguf
from jaxserve.models.loader.gguf_vocab import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, byte_level_bpe, sentencepiece_bpe

_SUPPORTED_MODELS = ("gpt2", "llama")


def load_gguf_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """The tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

    Special tokens come from the file's ids, tokens of type CONTROL are special (matched whole, skipped
    by ``decode(skip_special_tokens=True)``), ``add_bos_token`` follows ``tokenizer.ggml.add_bos_token``
    and ``chat_template`` is ``tokenizer.chat_template``.
    """
    path = os.fspath(path)
    fields = open_gguf(path).fields

    def field(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    K = gguf.Keys.Tokenizer
    kind = field(K.MODEL)
    tokens = field(K.LIST)
    if not tokens:
        raise ValueError(f"{path!r} has no {K.LIST!r} metadata, so it carries no tokenizer; pass one separately")
    token_types = field(K.TOKEN_TYPE) or [NORMAL] * len(tokens)

    embedded_json = field(K.HF_JSON)
    if embedded_json:  # some converters store the original tokenizer.json verbatim: nothing to rebuild
        backend = Tokenizer.from_str(embedded_json)
    elif kind == "gpt2":
        merges = field(K.MERGES)
        if not merges:
            raise ValueError(f"{path!r}: a byte-level BPE tokenizer needs {K.MERGES!r}, which the file lacks")
        backend = byte_level_bpe(tokens, merges, token_types, field(K.PRE))
    elif kind == "llama":
        scores = field(K.SCORES)
        if not scores:
            raise ValueError(f"{path!r}: a SentencePiece tokenizer needs {K.SCORES!r}, which the file lacks")
        backend = sentencepiece_bpe(tokens, scores, token_types, field(K.UNK_ID), bool(field(K.ADD_PREFIX, True)))
    else:
        raise ValueError(
            f"{path!r}: {K.MODEL}={kind!r} is not supported; supported: {', '.join(_SUPPORTED_MODELS)}. "
            "Load the model's Hugging Face directory (with tokenizer.json) instead"
        )
    if not embedded_json:
        _add_special_tokens(backend, tokens, token_types)

    def token(key: str) -> str | None:
        token_id = field(key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos, eos = token(K.BOS_ID), token(K.EOS_ID)
    # SentencePiece models start with BOS unless the file says otherwise (llama.cpp's default too).
    add_bos = bool(field(K.ADD_BOS, kind == "llama")) and bos is not None
    add_eos = bool(field(K.ADD_EOS, False)) and eos is not None
    backend.post_processor = _post_processor(bos if add_bos else None, eos if add_eos else None, backend)

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token(K.UNK_ID),
        pad_token=token(K.PAD_ID),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=_chat_template(fields, field),
        # Decoding must give back exactly what was encoded (no " ," -> "," tidying), so that
        # streamed text and the prompt round-trip.
        clean_up_tokenization_spaces=False,
    )


def _add_special_tokens(backend: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Register control/unknown tokens as special and user-defined tokens as whole-match added tokens.

    Both are already in the vocabulary, so adding them keeps their ids; without this the text
    "<|im_start|>" would be cut into BPE pieces.
    """
    typed = list(zip(tokens, token_types))
    special = [AddedToken(t, special=True, normalized=False) for t, kind in typed if kind in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, kind in typed if kind == USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _post_processor(bos: str | None, eos: str | None, backend: Tokenizer) -> processors.PostProcessor | None:
    """Wrap each encoded sequence in BOS/EOS as the file asks (None: leave ids as they are)."""
    if bos is None and eos is None:
        return None
    single = " ".join(x for x in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if x)
    pair = single + " " + " ".join(x for x in (bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _chat_template(fields: dict, field) -> str | dict[str, str] | None:
    """The default chat template, or a name -> template dict when the file also has named ones
    (``tokenizer.chat_template.<name>``, e.g. "tool_use")."""
    default = field(gguf.Keys.Tokenizer.CHAT_TEMPLATE)
    prefix = gguf.Keys.Tokenizer.CHAT_TEMPLATE + "."
    named = {key[len(prefix):]: field(key) for key in fields if key.startswith(prefix)}
    if not named:
        return default
    return {**({"default": default} if default else {}), **named}
