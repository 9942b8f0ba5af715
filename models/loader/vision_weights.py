"""Fill a Qwen2-VL vision tower with Hugging Face-named tensors (``visual.blocks.0.attn.qkv.weight``...).

The tower is small next to the decoder (0.6 B of 8 B parameters in Qwen2-VL-7B), so this is the plain
path: each parameter's HF name is its module path with the leaf renamed, kernels are transposed from
[out, in] and reshaped to the parameter's (possibly split) output axes. The one odd tensor is the
Conv3d patch kernel [E, C, Tp, P, P], flattened to [E, C*Tp*P*P] first.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.loader.weights import _LEAF_TO_HF

# The merger's MLP is HF's nn.Sequential(Linear, GELU, Linear): its second Linear is index 2 there, 1 here.
_RENAMES = (("merger.mlp.1.", "merger.mlp.2."),)


def load_vision_weights(tower: nnx.Module, tensors: Mapping[str, Any], *, prefix: str = "visual.") -> None:
    """Set every parameter of ``tower`` in place from ``tensors[prefix + hf_name]`` (cast to its dtype).

    Raises ValueError naming the missing tensor, or the tensor whose size does not fit its parameter.
    """
    _, state = nnx.split(tower)
    for path, var in nnx.to_flat_state(state):
        *modules, leaf = (str(p) for p in path)
        name = ".".join([*modules, _LEAF_TO_HF[leaf]])
        for ours, theirs in _RENAMES:
            name = name.replace(ours, theirs)
        name = prefix + name
        if name not in tensors:
            raise ValueError(f"vision weights: missing tensor {name!r} (is this a Qwen2-VL checkpoint?)")
        value = np.asarray(tensors[name])
        shape = var.get_value().shape
        if leaf == "kernel":
            value = value.reshape(value.shape[0], -1).T  # [out, in...] -> [in, out]
            value = value.reshape(shape[0], *shape[1:]) if value.size == np.prod(shape) else value
        if value.size != np.prod(shape):
            raise ValueError(f"vision weights: {name!r} has shape {np.shape(tensors[name])}, the model needs {shape}")
        var.set_value(jnp.asarray(value.reshape(shape), dtype=var.get_value().dtype))
