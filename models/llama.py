"""One decoder-only model for the Llama family: Llama 1/2/3, SmolLM2, Mistral, Qwen2 and Qwen3.

They share one block (pre-norm attention with RoPE, then a gated MLP); the differences are config
switches: q/k/v bias (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), a sliding window (Mistral,
Qwen2/3 when enabled), tied embeddings (SmolLM2, small Qwens) and the RoPE scaling type (Llama 3.1+).

Module attribute names follow the Hugging Face checkpoints (``model.layers.0.self_attn.o_proj``), so
the weight loader maps names mechanically (see jaxserve.models.loader.weights); the two fused
projections, ``qkv_proj`` and ``mlp.gate_up_proj``, are assembled from the checkpoint's pieces by a small
table there. Fewer, larger matmuls: a decode step reads the same bytes in fewer kernels.

The model reads and writes the paged KV cache only through ``attention_fn`` and never owns the cache:
caches come in as arguments and go out as results, which lets the runner donate them to the jitted step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import cpu_bf16
from jaxserve.models.config import TextModelConfig
from jaxserve.models.layers import (
    Embed, GatedMLP, Linear, RMSNorm, apply_rope, mrope_cos_sin, rope_cos_sin, rope_inv_freq,
)  # fmt: skip
from jaxserve.models.lora import LoRABatch
from jaxserve.pallas_kernels.attention import AttentionFn
from jaxserve.pallas_kernels.fp8 import is_fp8
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.pallas_kernels.precision import matmul_precision

KVCache = tuple[jax.Array, jax.Array]  # (k_pages, v_pages), each [num_blocks, block_size, K, Dh]


class LlamaAttention(nnx.Module):
    """Multi-head attention with grouped KV heads over the paged cache."""

    def __init__(
        self, cfg: TextModelConfig, layer_idx: int, *, dtype, param_dtype, attention_fn: AttentionFn, rngs,
        precision=None,
    ):  # fmt: skip
        d, h, k, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        precision = precision if precision is not None else matmul_precision(dtype)
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        if h % k:
            raise ValueError(f"num_attention_heads={h} is not a multiple of num_key_value_heads={k}")
        # One matmul for q, k and v: [D, K, G+2, Dh], per KV head its G query heads, then its key and value
        # (the loader assembles it from the checkpoint's q_proj, k_proj and v_proj).
        self.qkv_proj = Linear(
            d, (k, h // k + 2, dh), axes=("embed", "kv_heads", None, "head_dim"), use_bias=cfg.attention_bias, **kw
        )
        self.o_proj = Linear(h * dh, d, axes=("q_heads", "embed"), use_bias=cfg.o_proj_bias, **kw)
        if cfg.qk_norm:
            norm_kw = dict(eps=cfg.rms_norm_eps, param_dtype=param_dtype, axis_name="head_dim")
            self.q_norm = RMSNorm(dh, **norm_kw)
            self.k_norm = RMSNorm(dh, **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        # Static (not Variables): they become part of the graphdef, hence of the jit cache key.
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, dh
        self.scale = dh**-0.5
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        self.attention_fn = attention_fn
        self.precision = precision  # of the attention's products too: a float32 model is float32 throughout
        # fp8 KV cache scales (pallas_kernels/fp8.py), 1.0 as in vLLM. Static floats of this layer, passed to the
        # jitted attention as traced scalars: the layers share one trace whatever their values.
        self.k_scale = self.v_scale = 1.0

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        cos: jax.Array,  # [T, Dh] float32
        sin: jax.Array,  # [T, Dh] float32
        kv: KVCache,
        md: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[jax.Array, KVCache]:  # ([T, D], updated cache)
        t = x.shape[0]
        # [T, K, G+2, Dh]; with LoRA q, k and v's deltas added, each in its slice of the fused output (models/lora.py)
        qkv = self.qkv_proj(x) if lora is None else lora.project("qkv", x, self.qkv_proj)
        q = qkv[:, :, :-2].reshape(t, self.num_heads, self.head_dim)  # [T, H, Dh]: head h uses KV head h // G
        k, v = qkv[:, :, -2], qkv[:, :, -1]  # [T, K, Dh] each
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Only an fp8 cache takes scales, so that backends without fp8 keep their plain signature.
        fp8_kw = dict(k_scale=self.k_scale, v_scale=self.v_scale) if is_fp8(kv[0].dtype) else {}
        out, k_pages, v_pages = self.attention_fn(
            q, k, v, kv[0], kv[1], md, scale=self.scale, sliding_window=self.sliding_window, precision=self.precision,
            **fp8_kw,
        )  # out [T, H, Dh]
        out = out.reshape(t, self.num_heads * self.head_dim)  # [T, H*Dh]
        y = self.o_proj(out) if lora is None else lora.project("o", out, self.o_proj)  # [T, D]
        return y, (k_pages, v_pages)


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: TextModelConfig, layer_idx: int, *, dtype, param_dtype, attention_fn, precision=None, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, attention_fn=attention_fn, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = GatedMLP(cfg, **kw)

    def __call__(
        self, x, cos, sin, kv: KVCache, md: AttentionMetadata, lora: LoRABatch | None = None
    ) -> tuple[jax.Array, KVCache]:
        # x [T, D] -> [T, D]
        attn_out, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, md, lora)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x), lora)
        return x, kv


class LlamaModel(nnx.Module):
    """Embedding, the decoder stack (unrolled: a Python loop over an nnx.List) and the final norm."""

    def __init__(self, cfg: TextModelConfig, *, dtype, param_dtype, attention_fn, precision=None, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nnx.List(
            [LlamaDecoderLayer(cfg, i, attention_fn=attention_fn, **kw) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)


class LlamaForCausalLM(nnx.Module):
    """A Llama-family causal LM over a paged KV cache.

    ``__call__`` runs the decoder on a flat ragged batch and returns final-normed hidden states;
    ``compute_logits`` turns the few rows the sampler needs into float32 logits, so the [T, V] logits
    of a long prefill are never materialised.

    Every matmul (projections, attention, logits) runs at ``matmul_precision(dtype, fp32_matmul_precision)``:
    a float32 model computes float32 on a GPU too unless ``fp32_matmul_precision="tf32"``; bf16 and fp16
    models take JAX's default.
    """

    def __init__(
        self,
        cfg: TextModelConfig,
        *,
        dtype,
        param_dtype,
        attention_fn: AttentionFn,
        rngs: nnx.Rngs,
        fp32_matmul_precision: str = "highest",
    ):
        self.config = cfg
        _inv_freq(cfg)  # a bad rope_scaling dict fails here, at build time, not in the first step
        precision = matmul_precision(dtype, fp32_matmul_precision)  # a bad value fails here too
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.model = LlamaModel(cfg, attention_fn=attention_fn, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, axes=("embed", "vocab"), **kw)

    def __call__(
        self,
        input_ids: jax.Array,  # [T] int32
        kv_caches: list[KVCache],  # one per layer
        md: AttentionMetadata,
        *,
        mrope_positions: jax.Array | None = None,  # [3, T] int32, required iff cfg.mrope_section
        inputs_embeds: jax.Array | None = None,  # [T, D]: used instead of embedding input_ids (images)
        lora: list[LoRABatch] | None = None,  # per layer: adapter slots and the tokens' slot mask (models/lora.py)
        aux_layers: tuple[int, ...] = (),  # EAGLE: also return these hidden states (see below)
    ):  # (hidden [T, D], updated caches), plus aux [T, len(aux_layers) * D] when aux_layers
        """``aux_layers`` index the hidden states as Hugging Face's ``output_hidden_states`` does: i < L is the
        input of layer i (0: the embeddings), L the final normed output. Their concatenation comes back third:
        what an EAGLE head reads from the target (jaxserve.spec_decode.eagle)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for a model of {len(self.model.layers)} layers")
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, D]
        cos, sin = self._rope(md.positions, mrope_positions)  # [T, Dh] each
        new_caches, taken = [], {}
        lora = lora if lora is not None else [None] * len(kv_caches)
        for i, (layer, kv, layer_lora) in enumerate(zip(self.model.layers, kv_caches, lora)):
            if i in aux_layers:
                taken[i] = x
            x, kv = layer(x, cos, sin, kv, md, layer_lora)
            new_caches.append(kv)
        out = self.model.norm(x)
        if not aux_layers:
            return out, new_caches
        taken[len(self.model.layers)] = out
        return out, new_caches, jnp.concatenate([taken[i] for i in aux_layers], axis=-1)

    def _rope(self, positions, mrope_positions) -> tuple[jax.Array, jax.Array]:
        # M-RoPE rotates by three position rows (Qwen2-VL); md.positions stays the 1-D cache position
        # that the attention's causal mask and KV slots use.
        section = self.config.mrope_section
        if section is None:
            return rope_cos_sin(positions, _inv_freq(self.config))
        if mrope_positions is None:
            raise ValueError(f"mrope_section={list(section)} needs mrope_positions [3, T] in each step")
        return mrope_cos_sin(mrope_positions, _inv_freq(self.config), section)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # hidden [S, D] (already normed) -> [S, V] float32
        if self.lm_head is None:
            return self.model.embed_tokens.attend(hidden)
        if self.lm_head.weight_block or self.lm_head.fp8_mode:  # codes: the head's own product, float32 out
            return self.lm_head.product(hidden, jnp.float32)
        kernel = self.lm_head.kernel[...]  # [D, V]
        return cpu_bf16.matmul(hidden.astype(kernel.dtype), kernel, self.lm_head.precision)  # float32 logits


@functools.lru_cache(maxsize=None)
def _inv_freq(cfg: TextModelConfig) -> np.ndarray:  # [R] float32
    return rope_inv_freq(cfg)
