"""Qwen2-VL: the vision tower, and the Qwen2 decoder with M-RoPE whose image placeholder tokens take the
tower's embeddings.

Two device calls, as the engine will run them: ``encode_images`` for a step's new images (jitted, [B, N]
image slots bucketed by patch rows), then the ordinary decoder step, which takes the image embeddings of this step's
tokens through ``embed_index`` (row of ``image_embeds`` per token, -1 for text). Indexing per token, not
"the next placeholder", lets a prefill chunk begin or end inside an image.

Parameters keep HF's hub names (``visual.blocks.0...``, ``model.layers.0...``, ``lm_head``): the decoder is
jaxserve's Llama-family model (architecture "qwen2" with ``mrope_section``), the tower ``qwen2_vl_vision``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import TextModelConfig
from jaxserve.models.llama import KVCache, LlamaForCausalLM
from jaxserve.models.qwen2_vl_vision import Qwen2VisionTransformer, VisionConfig
from jaxserve.pallas_kernels.attention import AttentionFn
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.pallas_kernels.precision import matmul_precision


@dataclasses.dataclass(frozen=True)
class Qwen2VLConfig:
    text: TextModelConfig  # architecture "qwen2", mrope_section set
    vision: VisionConfig
    image_token_id: int
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> "Qwen2VLConfig":
        """config.json of a Qwen2VLForConditionalGeneration: transformers 4 (text fields at the top level,
        ``rope_scaling: {type: mrope, mrope_section}``) or 5 (``text_config``, ``rope_parameters``)."""
        if d.get("model_type") not in (None, "qwen2_vl"):
            raise ValueError(f"model_type={d.get('model_type')!r} is not a Qwen2-VL config (want 'qwen2_vl')")
        text = dict(d.get("text_config") or {k: v for k, v in d.items() if k != "vision_config"})
        if "tie_word_embeddings" in d:  # transformers 5 keeps it at the top level only
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
        text.pop("rope_scaling", None)
        section = rope.pop("mrope_section", None)
        if section is None:
            raise ValueError("Qwen2-VL config has no mrope_section in rope_scaling / rope_parameters")
        if rope.get("rope_type", rope.get("type")) == "mrope":  # transformers 4 spelling of plain RoPE + M-RoPE
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text["rope_parameters"] = {**rope, "rope_theta": rope.get("rope_theta", text.get("rope_theta", 1000000.0))}
        text["model_type"] = "qwen2"
        text_cfg = TextModelConfig.from_hf_config(text)
        text_cfg = dataclasses.replace(text_cfg, mrope_section=tuple(int(s) for s in section))
        image_token_id = d.get("image_token_id")
        if image_token_id is None:
            raise ValueError("Qwen2-VL config has no image_token_id")
        return cls(
            text=text_cfg,
            vision=VisionConfig.from_hf_config(d.get("vision_config") or {}),
            image_token_id=int(image_token_id),
            vision_start_token_id=d.get("vision_start_token_id"),
            vision_end_token_id=d.get("vision_end_token_id"),
        )


class Qwen2VLForConditionalGeneration(nnx.Module):
    """``visual`` (the tower) + the decoder's ``model`` and ``lm_head`` (a LlamaForCausalLM's, shared)."""

    def __init__(self, cfg: Qwen2VLConfig, visual: Qwen2VisionTransformer, language: LlamaForCausalLM):
        if cfg.vision.hidden_size != cfg.text.hidden_size:
            raise ValueError(
                f"vision_config.hidden_size={cfg.vision.hidden_size} must equal the decoder's "
                f"hidden_size={cfg.text.hidden_size} (the merger projects into it)"
            )
        self.vl_config = cfg
        self.config = cfg.text  # what the runner sizes KV caches from
        self.visual = visual
        self.language = language

    @classmethod
    def build(
        cls, cfg: Qwen2VLConfig, *, dtype, param_dtype, attention_fn: AttentionFn, rngs: nnx.Rngs,
        fp32_matmul_precision: str = "highest",
    ) -> "Qwen2VLForConditionalGeneration":  # fmt: skip
        """Freshly initialised (random) parameters."""
        precision = matmul_precision(dtype, fp32_matmul_precision)
        visual = Qwen2VisionTransformer(
            cfg.vision, dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision
        )
        language = LlamaForCausalLM(
            cfg.text, dtype=dtype, param_dtype=param_dtype, attention_fn=attention_fn, rngs=rngs,
            fp32_matmul_precision=fp32_matmul_precision,
        )  # fmt: skip
        return cls(cfg, visual, language)

    def encode_images(
        self, pixel_values: jax.Array, positions: jax.Array, image_ids: jax.Array
    ) -> jax.Array:  # [N, C*Tp*P*P], [N, 2], [N] -> [N // m**2, D]: one row per placeholder token
        return self.visual(pixel_values, positions, image_ids)

    def __call__(
        self,
        input_ids: jax.Array,  # [T] int32
        kv_caches: list[KVCache],
        md: AttentionMetadata,
        *,
        mrope_positions: jax.Array,  # [3, T] int32
        image_embeds: jax.Array | None = None,  # [M, D]: this step's image rows
        embed_index: jax.Array | None = None,  # [T] int32: row of image_embeds per token, -1 for text
    ) -> tuple[jax.Array, list[KVCache]]:  # (hidden [T, D], updated caches)
        x = self.language.model.embed_tokens(input_ids)  # [T, D]
        if image_embeds is not None:
            rows = jnp.take(image_embeds, jnp.maximum(embed_index, 0), axis=0).astype(x.dtype)  # [T, D]
            x = jnp.where((embed_index >= 0)[:, None], rows, x)
        return self.language(input_ids, kv_caches, md, mrope_positions=mrope_positions, inputs_embeds=x)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [S, D] -> [S, V] float32
        return self.language.compute_logits(hidden)
