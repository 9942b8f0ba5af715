"""The Qwen2-VL vision tower in Flax NNX: patch embedding, ViT blocks with 2-D rotary embeddings and
attention within each image, and the 2x2 patch merger into the language model's width.

Input is what the Qwen2-VL image processor gives: ``pixel_values`` [N, C*Tp*P*P], one row per 14x14 patch
(two frames deep: a still image is repeated), rows already in merge-window order (each 2x2 window of
patches is 4 consecutive rows), and ``image_grid_thw`` [I, 3], each image's (t, h, w) in patches.

The jitted forward sees only fixed-shape arrays: the patch rows, their (h, w) grid coordinates and an
image id per row (``vision_inputs`` computes both on the host from ``image_grid_thw``). Attention masks
on the image id, so several images (and padding rows with id -1, for shape bucketing) share one call.
Every array may carry leading batch axes ([B, N, ...]: B image slots of N rows each): attention is then
[B, Hv, N, N] instead of one [Hv, B*N, B*N], which is how many same-bucket images should be encoded.

Module attribute names follow HF's ``Qwen2VisionTransformerPretrainedModel`` (``blocks.0.attn.qkv``,
``merger.mlp.0``), so its weights load by name (the Conv3d patch kernel flattened to a Linear kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.layers import Linear, _param
from jaxserve.pallas_kernels.precision import matmul_precision

# Shape letters here: N patch rows, E vision width (embed_dim), Hv vision heads, Dv = E // Hv,
# M merged tokens (N // merge**2), D the language model's width, I images.

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The fields of HF's ``Qwen2VLVisionConfig`` the tower is built from (hashable: static under jit)."""

    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 3584  # the language model's width: the merger's output
    num_heads: int = 16
    mlp_ratio: float = 4
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.embed_dim % self.num_heads:
            raise ValueError(f"vision embed_dim={self.embed_dim} is not a multiple of num_heads={self.num_heads}")
        if (self.embed_dim // self.num_heads) % 4:
            raise ValueError(
                f"vision head dim {self.embed_dim // self.num_heads} must be a multiple of 4 (2-D rotary halves)"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"vision hidden_act={self.hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
            )

    @property
    def patch_dim(self) -> int:  # one pixel_values row
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> "VisionConfig":
        """From config.json's ``vision_config`` dict (transformers 4 or 5 field names)."""
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        kw = {k: d[k] for k in fields if d.get(k) is not None}
        if d.get("in_chans") is not None:  # the released checkpoints' (transformers 4.4x) spelling
            kw.setdefault("in_channels", d["in_chans"])
        return cls(**kw, rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))))


def vision_inputs(grid_thw: np.ndarray, spatial_merge_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Host-side per-patch metadata from ``image_grid_thw`` [I, 3]: (positions [N, 2] int32, the (h, w)
    grid coordinates of each row in the processor's merge-window order; image_ids [N] int32).

    Every frame of a video attends only within itself (HF's cu_seqlens repeat h*w per frame), so the id
    counts frames, not images.
    """
    m = spatial_merge_size
    positions, ids = [], []
    frame = 0
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).tolist():
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")  # [h, w] each
        # Rows come window by window: (h/m, m, w/m, m) -> (h/m, w/m, m, m).
        hh = hh.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
        ww = ww.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
        for _ in range(t):
            positions.append(np.stack([hh, ww], axis=-1))
            ids.append(np.full(h * w, frame))
            frame += 1
    return np.concatenate(positions).astype(np.int32), np.concatenate(ids).astype(np.int32)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm (eps 1e-6 in this tower), computed in float32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype):
        self.eps = eps
        self.scale = _param(None, (dim,), param_dtype, ("embed",), "ones")
        self.bias = _param(None, (dim,), param_dtype, ("embed",), "zeros")

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> same
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...].astype(jnp.float32)
        return (y + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, **kw):
        e = cfg.embed_dim
        self.num_heads, self.head_dim = cfg.num_heads, e // cfg.num_heads
        self.qkv = Linear(e, (3, cfg.num_heads, self.head_dim), axes=("embed", None, "q_heads", None),
                          use_bias=True, **kw)  # fmt: skip
        self.proj = Linear(e, e, axes=("q_heads", "embed"), use_bias=True, **kw)

    def __call__(self, x, cos, sin, image_ids):  # x [..., N, E], cos/sin [..., N, Dv], ids [..., N] -> [..., N, E]
        qkv = self.qkv(x)  # [..., N, 3, Hv, Dv]
        q, k, v = _rotate(qkv[..., 0, :, :], cos, sin), _rotate(qkv[..., 1, :, :], cos, sin), qkv[..., 2, :, :]
        prec = self.proj.precision
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=prec, preferred_element_type=jnp.float32)
        scores = scores * np.float32(self.head_dim**-0.5)  # [..., Hv, N, N]
        same = image_ids[..., :, None] == image_ids[..., None, :]  # [..., N, N]: attend within the image only
        probs = jax.nn.softmax(jnp.where(same[..., None, :, :], scores, -jnp.inf), axis=-1).astype(v.dtype)
        out = jnp.einsum("...hqk,...khd->...qhd", probs, v, precision=prec)  # [..., N, Hv, Dv]
        return self.proj(out.reshape(*out.shape[:-2], -1))


class VisionMlp(nnx.Module):
    def __init__(self, cfg: VisionConfig, **kw):
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = Linear(cfg.embed_dim, hidden, axes=("embed", "mlp"), use_bias=True, **kw)
        self.fc2 = Linear(hidden, cfg.embed_dim, axes=("mlp", "embed"), use_bias=True, **kw)
        self.act = cfg.hidden_act

    def __call__(self, x):  # [N, E] -> [N, E]
        return self.fc2(_ACTIVATIONS[self.act](self.fc1(x)))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype, **kw):
        self.norm1 = LayerNorm(cfg.embed_dim, param_dtype=param_dtype)
        self.norm2 = LayerNorm(cfg.embed_dim, param_dtype=param_dtype)
        self.attn = VisionAttention(cfg, param_dtype=param_dtype, **kw)
        self.mlp = VisionMlp(cfg, param_dtype=param_dtype, **kw)

    def __call__(self, x, cos, sin, image_ids):  # [N, E] -> [N, E]
        x = x + self.attn(self.norm1(x), cos, sin, image_ids)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nnx.Module):
    """HF's Conv3d with stride = kernel over one patch is a matmul: ``proj.kernel`` [C*Tp*P*P, E] is the
    conv weight [E, C, Tp, P, P] flattened and transposed (rows of pixel_values are in (C, Tp, P, P) order)."""

    def __init__(self, cfg: VisionConfig, **kw):
        self.proj = Linear(cfg.patch_dim, cfg.embed_dim, axes=(None, "embed"), **kw)

    def __call__(self, pixels):  # [N, C*Tp*P*P] -> [N, E]
        return self.proj(pixels)


class PatchMerger(nnx.Module):
    """LayerNorm, then each merge window's m*m rows concatenated and projected by a 2-layer GELU MLP to D."""

    def __init__(self, cfg: VisionConfig, *, param_dtype, **kw):
        self.window = cfg.embed_dim * cfg.spatial_merge_size**2
        self.ln_q = LayerNorm(cfg.embed_dim, param_dtype=param_dtype)
        self.mlp = nnx.List([
            Linear(self.window, self.window, axes=(None, "mlp"), use_bias=True, param_dtype=param_dtype, **kw),
            Linear(self.window, cfg.hidden_size, axes=("mlp", "embed"), use_bias=True, param_dtype=param_dtype, **kw),
        ])  # fmt: skip  (HF's nn.Sequential indices 0 and 2; index 1 is the GELU)

    def __call__(self, x):  # [..., N, E] -> [..., M, D]
        x = self.ln_q(x)
        x = x.reshape(*x.shape[:-2], -1, self.window)  # [..., M, m*m*E]
        return self.mlp[1](jax.nn.gelu(self.mlp[0](x), approximate=False))


class Qwen2VisionTransformer(nnx.Module):
    """pixel rows -> merged image embeddings [M, D], one per image placeholder token."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, precision=None):
        precision = precision if precision is not None else matmul_precision(dtype)
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg, **kw)
        self.blocks = nnx.List([VisionBlock(cfg, **kw) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, **kw)
        self.dtype = dtype

    def __call__(
        self,
        pixel_values: jax.Array,  # [..., N, C*Tp*P*P] (leading axes: image slots, see the module doc)
        positions: jax.Array,  # [N, 2] int32 (h, w) grid coordinates
        image_ids: jax.Array,  # [N] int32; -1 for padding rows
    ) -> jax.Array:  # [..., N // m**2, D]
        x = self.patch_embed(pixel_values.astype(self.dtype))  # [N, E]
        cos, sin = vision_rope_cos_sin(positions, self.config)  # [N, Dv] each
        for block in self.blocks:
            x = block(x, cos, sin, image_ids)
        return self.merger(x)


def vision_rope_cos_sin(positions: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """2-D rotary tables [N, Dv] float32: the first half of each rotary half turns with h, the second with w
    (Dv // 4 frequencies each), laid out for the rotate-half convention."""
    dv = cfg.embed_dim // cfg.num_heads
    spatial = dv // 2
    inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, spatial, 2).astype(np.float32) / np.float32(spatial)))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., N, 2, Dv/4]
    hw = freqs.reshape(*positions.shape[:-1], -1)  # [..., N, Dv/2]: h freqs then w freqs
    emb = jnp.concatenate([hw, hw], axis=-1)  # [N, Dv]
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of x [..., N, Hv, Dv] by cos/sin [..., N, Dv], in float32 (as HF's vision rotary)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)
