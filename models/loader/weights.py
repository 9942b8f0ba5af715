"""Fill an abstract model with real weights from Hugging Face-named tensors.

The model's attribute names mirror the checkpoint's, so a parameter's path *is* its tensor name after
two renames: the NNX leaf (``kernel`` / ``embedding`` / ``scale``) is HF's ``weight``, and a ``kernel``
is stored [in, out] where HF stores [out, in]. The one table, ``FUSED``, names the projections the model
runs as one matmul (qkv, gate-up): such a parameter is assembled from its checkpoint pieces, on the
device, once the last piece has arrived.

Memory: tensors are read, moved to the device, transposed and cast one at a time, so the host never
holds more than one tensor (the tensor source is expected to be lazy, like the safetensors reader).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.models.config import TextModelConfig
from jaxserve.models.loader.kv_scales import SCALE_SUFFIXES, apply_kv_scales, read_kv_scales
from jaxserve.models.registry import abstract_model
from jaxserve.pallas_kernels.attention import AttentionFn

# Tensors some checkpoints carry that the model recomputes or does not use.
# KV cache scales are read apart (kv_scales.py), not as parameters.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",) + SCALE_SUFFIXES

_LEAF_TO_HF = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias",
               # block-quantized weights (models/quantized.py): the codes are "weight", beside these two
               "kernel_scale": "weight_scale", "kernel_offset": "weight_offset",
               "embedding_scale": "weight_scale", "embedding_offset": "weight_offset"}
# Leaves stored [in, ...] where the checkpoint stores [..., in]: a kernel and its block scales and offsets.
_TRANSPOSED_LEAVES = ("kernel", "kernel_scale", "kernel_offset")

# Anything with ``.shape`` that np.asarray accepts (numpy arrays, jax arrays, safetensors' numpy output),
# or a DeviceDecodable.
Tensor = Any


@runtime_checkable
class DeviceDecodable(Protocol):
    """A stored tensor that builds its parameter on the device itself (a GGUF tensor dequantizes its
    packed blocks there, so the host never holds the float32 copy)."""

    shape: tuple[int, ...]  # the HF (checkpoint) shape

    def to_param(self, *, transpose: bool, dtype: Any, sharding: Any = None) -> jax.Array: ...


# A fused module -> its checkpoint pieces and each piece's size along the fused parameter's axis -2 (the
# group axis: qkv [D, K, G+2, Dh] and gate-up [D, 2, F]; biases lack the leading D); None: what is left.
FUSED: dict[str, tuple[tuple[str, int | None], ...]] = {
    "qkv_proj": (("q_proj", None), ("k_proj", 1), ("v_proj", 1)),
    "gate_up_proj": (("gate_proj", 1), ("up_proj", 1)),
}


def _hf_leaf_name(modules: list[str], leaf: str, path: tuple) -> str:
    if leaf not in _LEAF_TO_HF:
        raise ValueError(f"parameter {'.'.join(map(str, path))} has no Hugging Face naming rule (leaf {leaf!r})")
    return ".".join([*modules, _LEAF_TO_HF[leaf]])


def hf_pieces(path: tuple, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors (name, HF shape) a parameter is made of, in assembly order: one for a plain
    parameter (a kernel's HF shape is its transpose), several for a fused one.

    ('model', 'layers', 0, 'self_attn', 'o_proj', 'kernel') -> [('model.layers.0.self_attn.o_proj.weight', ...)]
    """
    *modules, leaf = (str(p) for p in path)
    is_kernel = leaf in _TRANSPOSED_LEAVES
    if modules and modules[-1] in FUSED:
        pieces, total = FUSED[modules[-1]], shape[-2]
        rest = total - sum(size for _, size in pieces if size is not None)
        out = []
        for name, size in pieces:
            piece_shape = (*shape[:-2], rest if size is None else size, shape[-1])  # [in?, ..., size, last]
            flat = int(np.prod(piece_shape[1:] if is_kernel else piece_shape))
            out.append((_hf_leaf_name([*modules[:-1], name], leaf, path), (flat, shape[0]) if is_kernel else (flat,)))
        return out
    hf_shape = (int(np.prod(shape[1:])), shape[0]) if is_kernel else tuple(shape)
    return [(_hf_leaf_name(modules, leaf, path), hf_shape)]


def expected_tensors(abstract_model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> checkpoint shape, for every checkpoint tensor the model is built from."""
    _, state = nnx.split(abstract_model)
    return {
        name: shape
        for path, var in nnx.to_flat_state(state)
        for name, shape in hf_pieces(path, var.get_value().shape)
    }


def check_tensor_names(expected: Iterable[str], found: Iterable[str], *, tied_embeddings: bool) -> None:
    """Raise ValueError listing missing and unexpected tensors (before any tensor is read)."""
    expected, found = set(expected), set(found)
    missing = sorted(expected - found)
    unexpected = sorted(n for n in found - expected if not _ignorable(n, tied_embeddings))
    problems = []
    if missing:
        problems.append(f"missing tensors {_clip(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_clip(unexpected)}")
    if problems:
        raise ValueError(
            "checkpoint does not match the model config: "
            + "; ".join(problems)
            + " (do the config and the weights come from the same model?)"
        )


def _ignorable(name: str, tied_embeddings: bool) -> bool:
    # Some tied checkpoints still save the (identical) output head.
    return name.endswith(_IGNORED_SUFFIXES) or (
        tied_embeddings and name in ("lm_head.weight", "lm_head.weight_scale", "lm_head.weight_offset"))


def load_weights(
    abstract_model: nnx.Module,
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    *,
    tied_embeddings: bool,
    shardings: Any = None,
    progress: bool = False,
) -> nnx.Module:
    """A real model: ``abstract_model``'s structure with every parameter taken from ``tensors``.

    ``tensors`` is either a mapping from HF names to arrays (may be lazy: each lookup reads one
    tensor; names are checked before anything is read) or a stream of ``(name, array)`` pairs (as
    the GGUF reader yields them; checked as they arrive). Each parameter gets the dtype of its
    abstract leaf. ``shardings``, if given, is a state-shaped tree of ``jax.sharding.Sharding``
    (e.g. from ``nnx.get_named_sharding``) placing each parameter.
    """
    graphdef, abstract_state = nnx.split(abstract_model)
    targets = {}  # checkpoint name -> (param path, its abstract Variable, piece index, piece HF shape)
    num_pieces = {}  # param path -> how many checkpoint tensors make it
    for path, var in nnx.to_flat_state(abstract_state):
        pieces = hf_pieces(path, var.get_value().shape)
        num_pieces[path] = len(pieces)
        for i, (name, shape) in enumerate(pieces):
            targets[name] = (path, var, i, shape)
    if isinstance(tensors, Mapping):
        check_tensor_names(targets, tensors.keys(), tied_embeddings=tied_embeddings)
        pairs = ((name, tensors[name]) for name in targets)
    else:
        pairs = iter(tensors)
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}

    seen: set[str] = set()
    pending: dict[tuple, dict[int, jax.Array]] = {}  # fused param path -> pieces read so far ([in, out] each)
    loaded = {}  # param path -> Variable
    bar = weights_bar([var.get_value() for _, var in nnx.to_flat_state(abstract_state)], progress)
    for name, raw in pairs:
        if name not in targets:
            if _ignorable(name, tied_embeddings):
                continue
            raise ValueError(f"checkpoint does not match the model config: unexpected tensor {name!r}")
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
        seen.add(name)
        path, var, index, want = targets[name]
        if tuple(raw.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(raw.shape)}, expected {want} from the model config")
        abstract = var.get_value()  # ShapeDtypeStruct
        sharding = flat_shardings.get(path)
        if isinstance(sharding, nnx.Variable):
            sharding = sharding.get_value()
        transpose = str(path[-1]) in _TRANSPOSED_LEAVES
        whole = num_pieces[path] == 1
        place = sharding if whole else None  # a piece is placed with the whole parameter, once assembled
        if isinstance(raw, DeviceDecodable):
            value = raw.to_param(transpose=transpose, dtype=abstract.dtype, sharding=place)
        else:
            value = _to_param(np.asarray(raw), transpose=transpose, dtype=abstract.dtype, sharding=place)
        del raw
        bar.update(value.nbytes)
        if not whole:
            parts = pending.setdefault(path, {})
            parts[index] = value
            if len(parts) < num_pieces[path]:
                continue
            value = _assemble(tuple(abstract.shape), sharding)(*(parts[i] for i in range(num_pieces[path])))
            del pending[path], parts
        loaded[path] = var.replace(value)
    bar.close()
    check_tensor_names(targets, seen, tied_embeddings=tied_embeddings)  # anything still missing
    return nnx.merge(graphdef, nnx.from_flat_state([(path, loaded[path]) for path in num_pieces]))


def load_from_hf_tensors(
    cfg: TextModelConfig,
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    *,
    dtype,
    attention_fn: AttentionFn,
    shardings_fn: Callable[[nnx.Module], Any] | None = None,
    progress: bool = False,
    fp32_matmul_precision: str = "highest",
    quantized_weights: bool = False,
) -> nnx.Module:
    """Build ``cfg``'s model with weights from HF-named tensors (a mapping or a stream of pairs).
    ``quantized_weights``: projections and embedding hold block-quantized codes (models/quantized.py), read from
    ``weight``, ``weight_scale`` and ``weight_offset`` tensors.

    ``shardings_fn(abstract_model)``, if given, returns the state-shaped shardings tree for
    ``load_weights``.
    """
    abstract = abstract_model(cfg, dtype=dtype, attention_fn=attention_fn, fp32_matmul_precision=fp32_matmul_precision,
                              quantized_weights=quantized_weights)
    shardings = shardings_fn(abstract) if shardings_fn is not None else None
    model = load_weights(
        abstract, tensors, tied_embeddings=cfg.tie_word_embeddings, shardings=shardings, progress=progress
    )
    apply_kv_scales(model, read_kv_scales(tensors))
    return model


def weights_bar(abstract_leaves: Iterable[Any], progress: bool) -> tqdm:
    """A progress bar over the bytes of the parameters being made (``abstract_leaves``: their
    ``ShapeDtypeStruct``s), so its rate reads in GB/s; hidden when ``progress`` is false."""
    total = sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in abstract_leaves)
    return tqdm(
        total=total, desc="Loading weights", unit="B", unit_scale=True, unit_divisor=1000, disable=not progress,
        leave=False,
    )  # fmt: skip


def param_bytes(model: nnx.Module) -> int:
    """Bytes of all parameters of ``model`` as placed (global sizes, in their dtypes)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _to_param(raw: np.ndarray, *, transpose: bool, dtype, sharding) -> jax.Array:
    # Transpose and cast on the device (fast there); the host copy is dropped right after.
    return _converter(transpose, jnp.dtype(dtype), sharding)(raw)


@functools.lru_cache(maxsize=None)
def _converter(transpose: bool, dtype, sharding) -> Callable[[np.ndarray], jax.Array]:
    def convert(x):  # [out, in] -> [in, out] when transposing
        return (x.T if transpose else x).astype(dtype)

    return jax.jit(convert, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _assemble(shape: tuple[int, ...], sharding) -> Callable[..., jax.Array]:
    """Pieces ([in, out_i] kernels or [out_i] biases) -> one fused parameter of ``shape``, joined along
    its group axis -2 (see FUSED)."""

    def assemble(*pieces):
        lead = shape[:-2]
        return jnp.concatenate([p.reshape(*lead, -1, shape[-1]) for p in pieces], axis=-2)

    return jax.jit(assemble, out_shardings=sharding)


def _clip(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names) - limit} more)' if len(names) > limit else ''}]"
