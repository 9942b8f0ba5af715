"""BERT-family encoders (BERT, MiniLM, BGE, E5, GTE-base...; RoBERTa and XLM-R: multilingual-e5, BGE-M3) for
embeddings: absolute learned positions, token-type embeddings, post-norm residual blocks and a GELU MLP, with
bidirectional attention. RoBERTa differs only in where positions start (after its padding id).

The model runs on a flat packed batch, as the decoder does: ``T`` tokens of ``S`` sequences laid end to
end, with ``seq_ids[T]`` saying which sequence each token belongs to. The tokens come in rows of
``row_len`` (no sequence crosses a row: the scheduler packs them so), and attention runs within each row,
masked to the token's own sequence (so packing never mixes sentences): [T/R, R, R] scores rather than
[T, T]. No KV cache: an encoder sees its whole input in one step and is done. Module attribute names
follow the Hugging Face checkpoint (``encoder.layer.0.attention.self.query``), so the generic weight loader
maps names mechanically.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.layers import Embed, Linear, _param
from jaxserve.pallas_kernels.precision import matmul_precision

ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
# HF class names, for the runner picked from a checkpoint (`runner="auto"`).
ENCODER_ARCHITECTURES = (
    "BertModel", "BertForMaskedLM", "BertForPreTraining", "RobertaModel", "RobertaForMaskedLM", "XLMRobertaModel",
    "XLMRobertaForMaskedLM",
)
# RoBERTa numbers positions from padding_idx + 1 (HF's create_position_ids_from_input_ids, for inputs
# without padding tokens inside them).
_OFFSET_POSITIONS = ("roberta", "xlm-roberta")
_GELU_EXACT = ("gelu",)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """What builds a BERT-family encoder; hashable, so it can be static in a jitted step."""

    architecture: str  # one of ENCODER_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    position_offset: int = 0  # added to each token's position: pad_token_id + 1 for RoBERTa, 0 for BERT
    checkpoint_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()  # none: an encoder never stops; kept for the engines' shared code

    def __post_init__(self):
        if self.hidden_act not in _GELU_EXACT + _GELU_TANH:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; supported: {_GELU_EXACT + _GELU_TANH}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_len(self) -> int:
        """The longest input the position table covers."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> "EncoderConfig":
        model_type = d.get("model_type")
        if model_type not in ENCODER_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not a supported encoder; supported: {ENCODER_MODEL_TYPES}")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type={d['position_embedding_type']!r} is not supported; only 'absolute' is"
            )
        dtype = d.get("torch_dtype") or d.get("dtype")
        pad = int(d.get("pad_token_id") or 0)
        return cls(
            architecture=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 512)),
            type_vocab_size=int(d.get("type_vocab_size", 2)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            hidden_act=d.get("hidden_act", "gelu"),
            pad_token_id=pad,
            position_offset=pad + 1 if model_type in _OFFSET_POSITIONS else 0,
            checkpoint_dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        )


class LayerNorm(nnx.Module):
    """HF's LayerNorm (mean and variance over the last axis, in float32), with ``scale`` and ``bias``."""

    def __init__(self, dim: int, *, eps: float, param_dtype):
        self.eps = eps
        self.scale = _param(None, (dim,), param_dtype, ("embed",), "ones")
        self.bias = _param(None, (dim,), param_dtype, ("embed",), "zeros")

    def __call__(self, x: jax.Array) -> jax.Array:  # x [T, D] -> [T, D], x's dtype
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)  # [T, 1]
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)  # [T, 1]
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def row_mask(seq_ids: jax.Array, row_len: int) -> jax.Array:  # [T] -> [N, R, R] bool, N = T // R
    """Token i may attend to token j of its row when both belong to the same sequence (padding has its own id)."""
    rows = seq_ids.reshape(-1, row_len)  # [N, R]
    return rows[:, :, None] == rows[:, None, :]


class BertSelfAttention(nnx.Module):
    def __init__(self, cfg: EncoderConfig, *, dtype, param_dtype, precision, rngs):
        d = cfg.hidden_size
        kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.query = Linear(d, d, axes=("embed", "q_heads"), **kw)
        self.key = Linear(d, d, axes=("embed", "q_heads"), **kw)
        self.value = Linear(d, d, axes=("embed", "q_heads"), **kw)
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.precision = precision

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # x [T, D], mask [N, R, R] -> [T, D]
        t, (n, r, _) = x.shape[0], mask.shape
        shape = (n, r, self.num_heads, self.head_dim)
        q, k, v = self.query(x).reshape(shape), self.key(x).reshape(shape), self.value(x).reshape(shape)
        scores = jnp.einsum("nthd,nshd->nhts", q, k, precision=self.precision, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, None], scores * self.head_dim**-0.5, -jnp.inf)  # [N, H, R, R]
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("nhts,nshd->nthd", probs, v, precision=self.precision)  # [N, R, H, Dh]
        return out.reshape(t, self.num_heads * self.head_dim)


class BertDenseNorm(nnx.Module):
    """LayerNorm(residual + dense(x)): the post-norm step after attention (``attention.output``) and after
    the MLP (``output``)."""

    def __init__(self, d_in: int, cfg: EncoderConfig, *, dtype, param_dtype, precision, rngs):
        in_axis = "mlp" if d_in != cfg.hidden_size else "q_heads"
        self.dense = Linear(
            d_in, cfg.hidden_size, axes=(in_axis, "embed"), use_bias=True, dtype=dtype, param_dtype=param_dtype,
            precision=precision, rngs=rngs,
        )  # fmt: skip
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:  # x [T, d_in], residual [T, D] -> [T, D]
        return self.LayerNorm(residual + self.dense(x))


class BertAttention(nnx.Module):
    def __init__(self, cfg: EncoderConfig, **kw):
        setattr(self, "self", BertSelfAttention(cfg, **kw))  # HF's name; `self.self = ...` reads badly
        self.output = BertDenseNorm(cfg.hidden_size, cfg, **kw)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        return self.output(getattr(self, "self")(x, mask), x)


class BertIntermediate(nnx.Module):
    def __init__(self, cfg: EncoderConfig, *, dtype, param_dtype, precision, rngs):
        self.dense = Linear(
            cfg.hidden_size, cfg.intermediate_size, axes=("embed", "mlp"), use_bias=True, dtype=dtype,
            param_dtype=param_dtype, precision=precision, rngs=rngs,
        )  # fmt: skip
        self.approximate = cfg.hidden_act in _GELU_TANH

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, F]
        return jax.nn.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nnx.Module):
    """Post-norm block: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, cfg: EncoderConfig, **kw):
        self.attention = BertAttention(cfg, **kw)
        self.intermediate = BertIntermediate(cfg, **kw)
        self.output = BertDenseNorm(cfg.intermediate_size, cfg, **kw)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEmbeddings(nnx.Module):
    def __init__(self, cfg: EncoderConfig, *, dtype, param_dtype, precision, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.word_embeddings = Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        self.position_embeddings = Embed(cfg.max_position_embeddings, cfg.hidden_size, **kw)
        self.token_type_embeddings = Embed(cfg.type_vocab_size, cfg.hidden_size, **kw)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, param_dtype=param_dtype)
        self.position_offset = cfg.position_offset

    def __call__(self, ids: jax.Array, type_ids: jax.Array, positions: jax.Array) -> jax.Array:  # [T] x3 -> [T, D]
        pos = self.position_embeddings(positions + self.position_offset)
        x = self.word_embeddings(ids) + pos + self.token_type_embeddings(type_ids)
        return self.LayerNorm(x)


class BertEncoder(nnx.Module):
    def __init__(self, cfg: EncoderConfig, **kw):
        self.layer = nnx.List([BertLayer(cfg, **kw) for _ in range(cfg.num_hidden_layers)])


class BertModel(nnx.Module):
    """The encoder stack; returns the last hidden states of every token (pooling is the runner's job).

    Every matmul runs at ``matmul_precision(dtype, fp32_matmul_precision)``, as in the decoder models.
    """

    def __init__(
        self, cfg: EncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs, fp32_matmul_precision="highest",
        row_len: int | None = None,
    ):  # fmt: skip
        self.config = cfg
        self.row_len = row_len  # attention rows of at most this many tokens; None: one row of the whole batch
        precision = matmul_precision(dtype, fp32_matmul_precision)
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.embeddings = BertEmbeddings(cfg, **kw)
        self.encoder = BertEncoder(cfg, **kw)

    def __call__(
        self,
        input_ids: jax.Array,  # [T] int32
        type_ids: jax.Array,  # [T] int32 (token types: 0 for a single sentence)
        positions: jax.Array,  # [T] int32, from 0 in each sequence
        seq_ids: jax.Array,  # [T] int32: the sequence of each token; padding tokens share an id of their own
    ) -> jax.Array:  # hidden [T, D]
        t = input_ids.shape[0]
        mask = row_mask(seq_ids, min(t, self.row_len or t))  # [N, R, R]
        x = self.embeddings(input_ids, type_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x
