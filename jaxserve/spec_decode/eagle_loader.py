"""Reading an EAGLE head checkpoint directory: config.json, then safetensors (or pytorch_model.bin) weights.

The layouts (jaxserve.models.eagle says what each tensor does):
- EAGLE-1: ``fc.weight`` [D, 2D] (``fc.bias`` optional), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``.
- EAGLE-3: ``fc.weight`` [D, 3D], ``midlayer.self_attn.{q,k,v}_proj.weight`` [., 2D], ``midlayer.o_proj``,
  ``midlayer.mlp.*``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``norm.weight``, ``lm_head.weight`` [V_draft, D], ``d2t`` [V_draft] (target id - draft id; absent: the
  draft vocabulary is the target's).
Either may carry ``embed_tokens.weight`` (a copy of the target's, unused: the head shares the target's) and
EAGLE-3 a ``t2d`` mask (unused). Names may have a ``model.`` prefix.

EAGLE-3 reads the target's hidden states at ``eagle_config.eagle_aux_hidden_state_layer_ids`` of its config
(Hugging Face ``output_hidden_states`` indices: the input of layer i), by default (2, L // 2, L - 3) for a
target of L layers; EAGLE-1 reads the final normed output (index L).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import numpy as np

_UNUSED = ("embed_tokens.weight", "t2d")


@dataclasses.dataclass(frozen=True)
class EagleSpec:
    version: int  # 1 or 3
    config: object  # the head's TextModelConfig (one layer)
    aux_layers: tuple[int, ...]  # target hidden states the head reads (HF output_hidden_states indices)
    aux_width: int  # their concatenated width
    draft_vocab_size: int


def read_spec(path: str, method: str, target_cfg) -> EagleSpec:
    """The head's config, checked against the target's."""
    from jaxserve.models.config import SUPPORTED_MODEL_TYPES, TextModelConfig

    if target_cfg.architecture not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"speculative_config method={method!r} needs a decoder-only target of the Llama family "
                         f"({', '.join(SUPPORTED_MODEL_TYPES)}), not {target_cfg.architecture!r}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(
            f"speculative_config model={path!r} has no config.json: give the directory of an EAGLE head checkpoint "
            "(e.g. a local copy of yuhuili/EAGLE-LLaMA3-Instruct-8B)"
        )
    with open(config_path) as f:
        d = json.load(f)
    d = {**d, "model_type": d.get("model_type") or "llama", "num_hidden_layers": 1}
    cfg = TextModelConfig.from_hf_config(d)
    version = 3 if method == "eagle3" else 1
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"speculative_config model={path!r} has hidden_size={cfg.hidden_size}, but the target has "
            f"{target_cfg.hidden_size}: an EAGLE head must be trained for this target"
        )
    n = target_cfg.num_hidden_layers
    if version == 1:
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"speculative_config model={path!r} has vocab_size={cfg.vocab_size}, the target "
                             f"{target_cfg.vocab_size}: an EAGLE-1 head scores with the target's lm_head")
        return EagleSpec(1, cfg, (n,), cfg.hidden_size, cfg.vocab_size)
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i <= n for i in ids):
        raise ValueError(f"EAGLE-3 head {path!r}: eagle_aux_hidden_state_layer_ids={list(ids)} must be 3 layer "
                         f"indices in [0, {n}] (the target has {n} layers)")
    return EagleSpec(3, cfg, ids, 3 * target_cfg.hidden_size, int(d.get("draft_vocab_size") or cfg.vocab_size))


def read_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, ``model.`` prefixes dropped (a head is small: read at once)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    out = {}
    if files:
        from safetensors.numpy import load_file

        for f in files:
            out.update(load_file(f))
    else:
        bins = sorted(glob.glob(os.path.join(path, "*.bin")))
        if not bins:
            raise ValueError(f"EAGLE head {path!r} has no *.safetensors or *.bin weights")
        import torch  # pytorch_model.bin (as the EAGLE-1 checkpoints ship): needs torch

        for f in bins:
            for name, t in torch.load(f, map_location="cpu", weights_only=True).items():
                out[name] = t.float().numpy() if t.is_floating_point() else t.numpy()
    return {name.removeprefix("model."): v for name, v in out.items()}


def load_head(
    spec: EagleSpec, path: str, *, dtype, attention_fn, seed: int, dummy: bool, fp32_matmul_precision, shardings_fn=None
):  # fmt: skip
    """(EagleHead, d2t [V_draft] int32 numpy). ``dummy``: random weights of the config's shape (benchmarks), on the
    default device; else each weight is placed as ``shardings_fn(abstract head)`` says (jaxserve.sharding)."""
    from flax import nnx

    from jaxserve.models.eagle import EagleHead
    from jaxserve.models.loader.weights import load_weights

    tensors = {} if dummy else read_tensors(path)
    kw = dict(
        aux_width=spec.aux_width, draft_vocab_size=spec.draft_vocab_size, fc_bias="fc.bias" in tensors,
        dtype=dtype, param_dtype=dtype, attention_fn=attention_fn, fp32_matmul_precision=fp32_matmul_precision,
    )  # fmt: skip
    d2t = np.asarray(tensors.get("d2t", np.zeros(spec.draft_vocab_size)), np.int32)
    if dummy:
        return EagleHead(spec.config, spec.version, rngs=nnx.Rngs(seed), **kw), d2t
    abstract = nnx.eval_shape(lambda: EagleHead(spec.config, spec.version, rngs=nnx.Rngs(0), **kw))
    weights = {name: v for name, v in tensors.items() if name not in _UNUSED and name != "d2t"}
    shardings = shardings_fn(abstract) if shardings_fn is not None else None
    return load_weights(abstract, weights, tied_embeddings=False, shardings=shardings), d2t
