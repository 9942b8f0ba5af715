"""EAGLE draft heads (speculative decoding): one Llama decoder layer that predicts the target's next hidden state.

The head runs on pairs: at position i it reads the embedding of token i + 1 and a hidden state for position i
(the target's, or the head's own output when drafting past the known tokens), and its output at i stands for
the hidden state that predicts token i + 2. It shares the target's token embedding (checkpoints that carry a
copy of it are read without it).

- EAGLE-1 (``version=1``, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): ``fc`` [2D -> D] on concat(embedding, hidden),
  where the target's hidden is its final normed output; the layer has no input norm (EAGLE's first layer skips
  it); the output goes straight to the *target's* lm_head, without a norm.
- EAGLE-3 (``version=3``, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): the target's hidden states of three layers
  (low, middle, high) are concatenated and projected by ``fc`` [3D -> D] (``project``); the head's own outputs
  are fed back unprojected. The layer normalises the embedding (``input_layernorm``) and the hidden state
  (``hidden_norm``) separately and attends over their concatenation (q/k/v take 2D inputs); the hidden state is
  the residual. Its own ``norm`` and ``lm_head`` score a draft vocabulary, mapped to target ids by ``d2t``
  (target id = draft id + d2t[draft id], passed in: it is no parameter).

Attribute names follow the checkpoints (``midlayer`` is EAGLE-3's name for the layer, ``layers.0`` EAGLE-1's), so
jaxserve.spec_decode.eagle_loader maps tensors by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import TextModelConfig
from jaxserve.models.layers import Linear, RMSNorm, rope_cos_sin
from jaxserve.models.llama import KVCache, LlamaDecoderLayer, _inv_freq
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.pallas_kernels.precision import matmul_precision


class EagleHead(nnx.Module):
    def __init__(
        self, cfg: TextModelConfig, version: int, *, aux_width: int, draft_vocab_size: int, fc_bias: bool,
        dtype, param_dtype, attention_fn, rngs: nnx.Rngs, fp32_matmul_precision: str = "highest",
    ):  # fmt: skip
        if version not in (1, 3):
            raise ValueError(f"EAGLE version={version} is not supported: 1 or 3")
        self.config, self.version = cfg, version
        precision = matmul_precision(dtype, fp32_matmul_precision)
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        d = cfg.hidden_size
        fc_in = 2 * d if version == 1 else aux_width
        self.fc = Linear(fc_in, d, axes=(None, "embed"), use_bias=fc_bias, **kw)
        layer = LlamaDecoderLayer(cfg, 0, attention_fn=attention_fn, **kw)
        if version == 1:
            layer.input_layernorm = None
            self.layers = nnx.List([layer])
        else:
            k, h, dh = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
            layer.self_attn.qkv_proj = Linear(
                2 * d, (k, h // k + 2, dh), axes=(None, "kv_heads", None, "head_dim"), use_bias=cfg.attention_bias,
                **kw,
            )  # fmt: skip
            layer.hidden_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=param_dtype)  # the checkpoint's place
            self.midlayer = layer
            self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
            self.lm_head = Linear(d, draft_vocab_size, axes=("embed", None), **kw)

    @property
    def layer(self) -> LlamaDecoderLayer:
        return self.layers[0] if self.version == 1 else self.midlayer

    def project(self, target_hidden: jax.Array) -> jax.Array:
        """The target's hidden states as the head's input: [T, W] -> [T, D] (EAGLE-3: ``fc``; EAGLE-1: as is)."""
        return self.fc(target_hidden) if self.version == 3 else target_hidden

    def __call__(
        self, embeds: jax.Array, hidden: jax.Array, kv: KVCache, md: AttentionMetadata
    ) -> tuple[jax.Array, KVCache]:
        """embeds [T, D] (of token i + 1), hidden [T, D] (projected, for position i) -> (output [T, D], cache)."""
        layer = self.layer
        cos, sin = rope_cos_sin(md.positions, _inv_freq(self.config))
        if self.version == 1:
            x = self.fc(jnp.concatenate([embeds, hidden.astype(embeds.dtype)], axis=-1))  # [T, D]
            attn, kv = layer.self_attn(x, cos, sin, kv, md)
        else:
            x = hidden.astype(embeds.dtype)  # the residual
            both = jnp.concatenate([layer.input_layernorm(embeds), layer.hidden_norm(x)], axis=-1)  # [T, 2D]
            attn, kv = layer.self_attn(both, cos, sin, kv, md)
        x = x + attn
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, kv

    def next_tokens(self, out: jax.Array, target, d2t: jax.Array) -> jax.Array:
        """The greedy proposal (a target token id) from the head's output rows: [S, D] -> [S] i32. ``d2t``
        [V_draft] i32 (EAGLE-3; kept outside the module, as it is no parameter)."""
        if self.version == 1:
            return jnp.argmax(target.compute_logits(out), axis=-1).astype(jnp.int32)
        normed = self.norm(out)
        kernel = self.lm_head.kernel[...]
        logits = jnp.dot(normed.astype(kernel.dtype), kernel, precision=self.lm_head.precision,
                         preferred_element_type=jnp.float32)  # [S, V_draft]
        draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return draft + d2t[draft]
