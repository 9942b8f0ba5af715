"""Load an embedding model: a BERT-family encoder, or a Llama/Qwen decoder run as an embedder.

Both come back with a ``hidden_states(ids, type_ids, positions, seq_ids)`` view (``EmbeddingModel``) so
the pooling runner never asks which kind it holds.

Checkpoint names vary more for embedders than for LMs: sentence-transformers saves a bare ``BertModel``
(``embeddings.*``) while a ``BertForMaskedLM`` prefixes ``bert.`` (``roberta.`` for RoBERTa); old BERT checkpoints name LayerNorm
parameters ``gamma``/``beta``; a bare decoder (``Qwen3Model``, ``MistralModel``) has no ``model.`` prefix
and no LM head. ``_Renamed`` maps them all onto the module paths, so the generic loader does the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.bert import ENCODER_MODEL_TYPES, BertModel, EncoderConfig
from jaxserve.models.packed_attention import packed_causal_attention
from jaxserve.pallas_kernels.metadata import AttentionMetadata

# Encoder tensors the embedding never uses (the NSP pooler, MLM heads, saved position-id buffers).
_ENCODER_UNUSED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


def checkpoint_is_encoder(path: str) -> bool:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type") in ENCODER_MODEL_TYPES
    except (OSError, ValueError):
        return False


@dataclasses.dataclass
class EmbeddingModel:
    """A loaded model and how to get its last hidden states on a packed batch."""

    model: nnx.Module  # BertModel or LlamaForCausalLM
    config: Any  # EncoderConfig or TextModelConfig
    is_encoder: bool

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_len(self) -> int:
        return max_input_len(self.config, self.is_encoder)


def hidden_states(
    graphdef, state, is_encoder: bool, ids, type_ids, positions, seq_ids
) -> jax.Array:  # [T] int32 each -> [T, D]
    """Pure function of the split model (what the runner jits)."""
    model = nnx.merge(graphdef, state)
    if is_encoder:
        return model(ids, type_ids, positions, seq_ids)
    t = ids.shape[0]
    zeros = jnp.zeros((t,), jnp.int32)
    # Only positions and token_seq_ids matter to packed_causal_attention; the rest are placeholders.
    md = AttentionMetadata(
        positions=positions, slot_mapping=zeros, token_seq_ids=seq_ids, query_start_loc=jnp.zeros((2,), jnp.int32),
        seq_lens=jnp.zeros((1,), jnp.int32), block_tables=jnp.zeros((1, 1), jnp.int32), logits_indices=zeros[:1],
    )  # fmt: skip
    placeholder = jnp.zeros((1,), model.model.embed_tokens.dtype)
    caches = [(placeholder, placeholder)] * len(model.model.layers)
    hidden, _ = model(ids, caches, md)
    return hidden


def read_embedding_config(path: str) -> tuple[Any, bool]:
    """(EncoderConfig or TextModelConfig, is_encoder), from config.json alone."""
    if checkpoint_is_encoder(path):
        with open(os.path.join(path, "config.json")) as f:
            return EncoderConfig.from_hf_config(json.load(f)), True
    from jaxserve.model_loader import read_text_config

    return read_text_config(path), False


def max_input_len(cfg: Any, is_encoder: bool) -> int:
    """The longest input the model takes (an encoder's position table, a decoder's context)."""
    return cfg.max_len if is_encoder else cfg.max_position_embeddings


def load_embedding_model(
    path: str, fmt: str, *, dtype, seed: int = 0, fp32_matmul_precision: str = "highest", progress: bool = False,
    row_len: int | None = None, shardings_fn=None,
) -> EmbeddingModel:  # fmt: skip
    """Build the embedding model of ``path`` (format "safetensors", "dummy", or for decoders "gguf"/"orbax").
    ``row_len``: attention runs in rows of this many packed tokens (see jaxserve.pooling_scheduler).
    ``shardings_fn(abstract_model)`` places the parameters as they load (tensor parallelism; a dummy encoder is
    placed by the runner)."""
    cfg, is_encoder = read_embedding_config(path)
    if is_encoder:
        kw = dict(dtype=dtype, param_dtype=dtype, fp32_matmul_precision=fp32_matmul_precision, row_len=row_len)
        if fmt == "dummy":
            model = BertModel(cfg, rngs=nnx.Rngs(seed), **kw)
        elif fmt == "safetensors":
            model = _load_encoder_weights(path, cfg, kw, progress, shardings_fn)
        else:
            raise ValueError(f"an encoder loads from safetensors (or load_format='dummy'), not {fmt!r}")
        return EmbeddingModel(model, cfg, True)
    return _load_decoder(path, fmt, dtype, seed, fp32_matmul_precision, progress, row_len, shardings_fn)


def _load_encoder_weights(path, cfg, kw, progress, shardings_fn=None) -> BertModel:
    from jaxserve.models.loader.hf import SafetensorsCheckpoint
    from jaxserve.models.loader.weights import load_weights

    abstract = nnx.eval_shape(lambda: BertModel(cfg, rngs=nnx.Rngs(0), **kw))
    shardings = shardings_fn(abstract) if shardings_fn is not None else None
    with SafetensorsCheckpoint(path) as ckpt:
        return load_weights(
            abstract, _Renamed(ckpt, _encoder_name), tied_embeddings=False, shardings=shardings, progress=progress
        )


def _encoder_name(name: str) -> str | None:
    for prefix in ("bert.", "roberta."):
        name = name.removeprefix(prefix)
    if name.startswith(_ENCODER_UNUSED):
        return None
    if name.endswith(".gamma"):
        return name[: -len("gamma")] + "weight"
    if name.endswith(".beta"):
        return name[: -len("beta")] + "bias"
    return name


def _decoder_name(name: str) -> str | None:
    if name.startswith("lm_head."):
        return None  # an embedder never computes logits
    return name if name.startswith("model.") else "model." + name


def _load_decoder(path, fmt, dtype, seed, fp32_matmul_precision, progress, row_len, shardings_fn) -> EmbeddingModel:
    from jaxserve.model_loader import load_model, read_text_config

    cfg = read_text_config(path)
    attention_fn = functools.partial(packed_causal_attention, row_len=row_len)
    # Tied: the model builds no lm_head, so a bare decoder checkpoint (no head) loads, and a causal LM's
    # head is skipped. Pooling never reads logits.
    cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    kw = dict(dtype=jnp.dtype(dtype), attention_fn=attention_fn, fp32_matmul_precision=fp32_matmul_precision,
              progress=progress, shardings_fn=shardings_fn)  # fmt: skip
    if fmt == "safetensors":
        from jaxserve.models.loader.hf import SafetensorsCheckpoint
        from jaxserve.models.loader.weights import load_from_hf_tensors

        with SafetensorsCheckpoint(path) as ckpt:
            model = load_from_hf_tensors(cfg, _Renamed(ckpt, _decoder_name), **kw)
    elif fmt == "dummy":
        from jaxserve.models.loader.dummy import load_dummy_model

        model = load_dummy_model(cfg, seed=seed, **kw)
    else:
        model, _ = load_model(path, fmt, seed=seed, **kw)
    return EmbeddingModel(model, cfg, False)


class _Renamed(Mapping[str, np.ndarray]):
    """A checkpoint seen under the model's names; ``rename`` returns None for tensors to leave out."""

    def __init__(self, ckpt: Mapping[str, Any], rename) -> None:
        self._ckpt = ckpt
        self._names = {}
        for name in ckpt:
            new = rename(name)
            if new is not None:
                self._names[new] = name

    def __getitem__(self, name: str):
        return self._ckpt[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
