"""Writing and restoring a converted checkpoint's weights with orbax-checkpoint.

Why: a GGUF or safetensors load reads, dequantizes, transposes and casts every tensor on the way in;
here the arrays are stored exactly as the model holds them (serving dtype, [in, out] kernels), so a load
is one restore straight into the mesh's shardings (each device reads its own slice) with nothing to
convert. The tree holds the state's path elements as string keys (``model/layers/0/self_attn/q_proj/kernel``),
so it does not depend on how flax flattens an nnx state. The directory layout and its checks are in
orbax_format.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import TextModelConfig
from jaxserve.models.loader.kv_scales import apply_kv_scales
from jaxserve.models.loader.orbax_format import (
    RECONVERT, WEIGHTS_DIR, CheckpointError, check_files, check_params, kv_scales_of, read_metadata,
)  # fmt: skip
from jaxserve.models.registry import abstract_model
from jaxserve.pallas_kernels.attention import AttentionFn

logger = logging.getLogger("jaxserve")


def param_name(path: tuple) -> str:
    """('model', 'layers', 0, 'self_attn', 'q_proj', 'kernel') -> 'model.layers.0.self_attn.q_proj.kernel'."""
    return ".".join(str(p) for p in path)


def _nested(flat: dict[tuple, Any]) -> dict:
    """{path: leaf} -> nested dicts with string keys (what orbax stores)."""
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = leaf
    return tree


def _lookup(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[str(key)]
    return tree


def save_weights(model: nnx.Module, out_dir: str) -> dict[str, dict]:
    """Write ``model``'s state under ``out_dir/weights``; returns {param name: {"shape", "dtype"}}."""
    import orbax.checkpoint as ocp

    _, state = nnx.split(model)
    flat = {path: var.get_value() for path, var in nnx.to_flat_state(state)}
    # Weights barely compress (zstd saves a few percent on bf16) but decompressing costs CPU time at every
    # start; older orbax versions without the option write zarr2 with zstd, which still restores.
    with _quiet_orbax():
        try:
            checkpointer = ocp.PyTreeCheckpointer(use_compression=False)
        except TypeError:
            checkpointer = ocp.PyTreeCheckpointer()
        checkpointer.save(os.path.join(os.path.abspath(out_dir), WEIGHTS_DIR), _nested(flat))
    return {param_name(p): {"shape": list(a.shape), "dtype": str(a.dtype)} for p, a in flat.items()}


def load_orbax_model(
    path: str,
    cfg: TextModelConfig,
    *,
    dtype,
    attention_fn: AttentionFn,
    shardings_fn: Callable[[nnx.Module], Any] | None = None,
    fp32_matmul_precision: str = "highest",
    progress: bool = True,  # noqa: ARG001 - orbax restores all arrays in one call: nothing to count
) -> nnx.Module:
    """The model of a converted directory, restored straight into ``shardings_fn(abstract_model)``.

    Restoring in the saved dtype copies bytes; another ``dtype`` is cast by the reader (logged, as it
    costs a pass over the weights; converting again with ``--dtype`` avoids it).
    """
    import orbax.checkpoint as ocp

    meta = read_metadata(path)
    abstract = abstract_model(cfg, dtype=dtype, attention_fn=attention_fn, fp32_matmul_precision=fp32_matmul_precision)
    graphdef, abstract_state = nnx.split(abstract)
    flat = nnx.to_flat_state(abstract_state)
    check_params(path, meta, {param_name(p): tuple(v.get_value().shape) for p, v in flat})
    check_files(path, meta)
    if jnp.dtype(dtype) != jnp.dtype(meta["dtype"]):
        logger.info("%s holds %s weights; casting them to %s while restoring (convert with --dtype %s to skip "
                    "the cast)", path, meta["dtype"], jnp.dtype(dtype).name, jnp.dtype(dtype).name)

    if shardings_fn is not None:
        shardings = {p: _unwrap(s) for p, s in nnx.to_flat_state(shardings_fn(abstract))}
    else:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = {p: device for p, _ in flat}
    target = _nested({
        p: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=shardings[p]) for p, v in flat
    })  # fmt: skip
    t0 = time.perf_counter()
    try:
        with _quiet_orbax():
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)  # shardings and dtypes per leaf
            restored = ocp.PyTreeCheckpointer().restore(
                os.path.join(os.path.abspath(path), WEIGHTS_DIR),
                args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
            )
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise ValueError, FileNotFoundError, ...
        raise CheckpointError(
            f"could not read the weights in {os.path.join(path, WEIGHTS_DIR)!r} ({type(e).__name__}: "
            f"{str(e)[:400]}); the checkpoint is damaged or incomplete: {RECONVERT.format(path=path)}"
        ) from e
    dt = time.perf_counter() - t0
    gb = meta.get("total_bytes", 0) / 1e9
    logger.info("restored %.2f GB of weights from %s in %.2fs (%.2f GB/s)", gb, path, dt, gb / max(dt, 1e-9))
    state = nnx.from_flat_state([(p, v.replace(_lookup(restored, p))) for p, v in flat])
    model = nnx.merge(graphdef, state)
    apply_kv_scales(model, kv_scales_of(meta))  # not arrays: static floats of the attention layers
    return model


def _unwrap(sharding: Any) -> Any:
    return sharding.get_value() if isinstance(sharding, nnx.Variable) else sharding


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs a dozen INFO lines per save or restore through absl; jaxserve logs one line of its own."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        absl_logger.setLevel(level)
