"""The device mesh and the one table that maps logical axis names to mesh axes.

Every array the engine places on devices is described by logical axis names (the model's parameters
carry them as nnx metadata, see jaxserve.models.layers; the KV cache and the step's inputs and outputs
are named here). ``LOGICAL_AXIS_RULES`` turns names into mesh axes; nothing else in the engine writes a
``PartitionSpec``.

Mesh. Axes ``("data", "model")``: ``data`` indexes the data-parallel replicas and ``model`` the devices
of one replica's tensor-parallel group. Each replica is an independent engine on one row of the global
mesh (a ``(1, tp)`` sub-mesh), so a replica's arrays never mention ``data``.

Tensor parallelism is Megatron's layout expressed as shardings: the q/k/v and gate/up projections are
split by output (heads, MLP intermediate), o_proj and down_proj by input, so each device computes whole
heads and XLA inserts one all-reduce after o_proj and one after down_proj. Meshes use
``AxisType.Auto`` so that XLA's partitioner also handles code written without sharding in mind (the jnp
reference attention's gathers, the embedding lookup).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger("jaxserve")

MESH_AXES = ("data", "model")

# logical axis name -> mesh axis (None: replicated).
LOGICAL_AXIS_RULES: dict[str, Optional[str]] = {
    # parameters (names from jaxserve.models.layers)
    "vocab": "model",  # embedding rows / lm_head columns: the largest matrices of small models
    "embed": None,  # the residual stream stays whole on every device
    "q_heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    # KV cache pages [N, P, K, Dh]: each device keeps the heads it computes
    "kv_blocks": None,
    "kv_block_slot": None,
    # step inputs and outputs: metadata is small and every device needs all of it; logits are gathered
    # whole because the sampler's top-k / top-p look across the full vocabulary row
    "batch": None,
    "logits_vocab": None,
    "tokens": None,  # attention's per-token activations [T, H or K, Dh] are split by their heads axis
    # EAGLE's hidden-state store [num_slots, W] (jaxserve.model_runner): split by width, as the KV cache is by
    # heads, so that each device holds 1/tp of it (W = 3D for EAGLE-3: per token more than a device's share of
    # an 8B model's KV at TP=8). A step writes its replicated hidden states into each device's columns without
    # communication; the head's read gathers [T, W] rows, one small all-gather or all-reduce around its fc.
    "store_slots": None,
    "store_width": "model",
}

KV_CACHE_AXES = ("kv_blocks", "kv_block_slot", "kv_heads", "head_dim")  # [N, P, K, Dh]
# Heads-major pages, the xla backend's (pallas_kernels/kv_layout.py): the same split, on axis 1.
KV_CACHE_HEADS_MAJOR_AXES = ("kv_blocks", "kv_heads", "kv_block_slot", "head_dim")  # [N, K, P, Dh]
# Token-minor V pages of an fp8 cache (pallas_kernels/kv_layout.py): the heads axis moves, the split does not.
V_CACHE_TOKEN_MINOR_AXES = ("kv_blocks", "kv_heads", "head_dim", "kv_block_slot")  # [N, K, Dh, P]
LOGITS_AXES = ("batch", "logits_vocab")  # [S, V]
Q_AXES = ("tokens", "q_heads", "head_dim")  # q and attention's output [T, H, Dh]
KV_NEW_AXES = ("tokens", "kv_heads", "head_dim")  # this step's k and v [T, K, Dh]
AUX_STORE_AXES = ("store_slots", "store_width")  # EAGLE's hidden-state store [num_slots, W]


def kv_cache_axes(heads_major: bool) -> tuple:
    """The logical axes of K pages (and of V pages unless token-minor) for a cache of this layout."""
    return KV_CACHE_HEADS_MAJOR_AXES if heads_major else KV_CACHE_AXES


def logical_spec(names: Sequence[Optional[str]], shape: Optional[Sequence[int]] = None, mesh: Optional[Mesh] = None):
    """The PartitionSpec for ``names``; with ``shape`` and ``mesh``, a dimension its mesh axis does not
    divide stays replicated (e.g. an odd vocabulary size), since uneven shards are not allowed."""
    axes = []
    for i, name in enumerate(names):
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise KeyError(f"logical axis {name!r} has no rule in jaxserve.sharding.LOGICAL_AXIS_RULES")
        axis = LOGICAL_AXIS_RULES.get(name) if name is not None else None
        if axis is not None and shape is not None and mesh is not None and shape[i] % mesh.shape[axis]:
            logger.info("axis %r of size %d is not divisible by mesh axis %r=%d: kept replicated",
                        name, shape[i], axis, mesh.shape[axis])
            axis = None
        axes.append(axis)
    return PartitionSpec(*axes)


def logical_sharding(mesh: Mesh, names: Sequence[Optional[str]], shape: Optional[Sequence[int]] = None) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(names, shape, mesh))


def param_shardings(abstract_model: nnx.Module, mesh: Mesh) -> Any:
    """State-shaped tree of NamedShardings from each parameter's logical names (the loaders' ``shardings_fn``)."""

    def place(var: nnx.Variable):
        names = var.get_metadata()["out_sharding"]
        return var.replace(logical_sharding(mesh, names, var.get_value().shape))

    return jax.tree.map(place, nnx.state(abstract_model), is_leaf=lambda x: isinstance(x, nnx.Variable))


def shardings_fn(mesh: Mesh):
    """The loaders' ``shardings_fn`` for ``mesh``."""
    return lambda abstract_model: param_shardings(abstract_model, mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# ----------------------------------------------------------------- meshes


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    """The global ``(data, model)`` mesh over the first dp * tp devices (all processes' devices under
    jax.distributed). A replica's TP group is a mesh row: on GPUs, neighbouring device ids share the
    fastest links, so the all-reduces of TP stay on them."""
    devices = list(jax.devices() if devices is None else devices)
    check_device_count(tensor_parallel_size, data_parallel_size, len(devices), devices[0].platform)
    need = tensor_parallel_size * data_parallel_size
    grid = np.array(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def check_device_count(tensor_parallel_size: int, data_parallel_size: int, count: int, platform: str) -> None:
    need = tensor_parallel_size * data_parallel_size
    if need > count:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} needs {need} "
            f"devices, but only {count} {platform} device(s) are present; lower one of them "
            "(their product must be at most the device count)"
        )


def replica_meshes(global_mesh: Mesh) -> list[Mesh]:
    """One ``(1, tp)`` mesh per data-parallel replica: row i of the global mesh."""
    return [
        Mesh(global_mesh.devices[i : i + 1], MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
        for i in range(global_mesh.shape["data"])
    ]


def check_tensor_parallel(text_config, tensor_parallel_size: int) -> None:
    """TP splits whole heads: the head counts must divide evenly (checked before any weight is read)."""
    tp = tensor_parallel_size
    for what, n in (("attention heads", text_config.num_attention_heads),
                    ("key/value heads", text_config.num_key_value_heads)):
        if n % tp:
            ok = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {n} {what}; use one of {ok}"
            )


def shard_attention(attention_fn: Callable, mesh: Mesh) -> Callable:
    """Run a kernel attention per device on its own heads (``jax.shard_map``).

    XLA cannot split a Pallas call the way it splits jnp code, so a kernel backend under TP is wrapped:
    each device gets its H/tp query heads, the K/tp KV heads they read and its slice of the cache, and
    runs the unchanged kernel on them; no collective is needed, because heads never attend across
    each other. The metadata is replicated.
    """
    from jaxserve.pallas_kernels import kv_layout

    q_spec, kv_spec = logical_spec(Q_AXES), logical_spec(KV_NEW_AXES)
    pages_spec = logical_spec(KV_CACHE_AXES)

    def sharded(q, k_new, v_new, k_pages, v_pages, md, *, scale: float, sliding_window=None, precision=None, **fp8_kw):
        per_device = functools.partial(attention_fn, scale=scale, sliding_window=sliding_window, precision=precision)
        names = sorted(fp8_kw)  # k_scale, v_scale over an fp8 cache: replicated scalars, passed as arguments
        # The kernel backends (pallas) keep an fp8 cache's V token-minor when kv_layout's switch is on.
        v_spec = logical_spec(V_CACHE_TOKEN_MINOR_AXES) if kv_layout.v_token_minor(v_pages.dtype) else pages_spec
        return jax.shard_map(
            lambda *a: per_device(*a[:6], **dict(zip(names, a[6:]))),
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, pages_spec, v_spec, PartitionSpec()) + (PartitionSpec(),) * len(names),
            out_specs=(q_spec, pages_spec, v_spec),
            check_vma=False,  # a Pallas call has no varying-axis typing rule
        )(q, k_new, v_new, k_pages, v_pages, md, *(jnp.asarray(fp8_kw[n], jnp.float32) for n in names))

    return sharded
