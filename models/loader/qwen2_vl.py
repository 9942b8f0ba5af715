"""Load a Qwen2-VL Hugging Face directory (config.json + safetensors) into Qwen2VLForConditionalGeneration.

The decoder goes through the common loader (fused qkv / gate-up, tied-embedding rules) on its own names;
the tower through ``load_vision_weights``. Both hub spellings are read: transformers 4 / the released
checkpoints (``visual.*``, ``model.layers.*``) and transformers 5's module paths (``model.visual.*``,
``model.language_model.*``), renamed to the former.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from flax import nnx

from jaxserve.models.loader.hf import SafetensorsCheckpoint
from jaxserve.models.loader.vision_weights import load_vision_weights
from jaxserve.models.loader.weights import load_from_hf_tensors
from jaxserve.models.qwen2_vl import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from jaxserve.models.qwen2_vl_vision import Qwen2VisionTransformer
from jaxserve.pallas_kernels.attention import AttentionFn
from jaxserve.pallas_kernels.precision import matmul_precision

_V5_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "model."))


class _Part(Mapping[str, Any]):
    """The checkpoint's tensors of one part (vision or text), under hub (transformers 4) names; lazy."""

    def __init__(self, ckpt: Mapping[str, Any], *, vision: bool):
        self._ckpt = ckpt
        self._names = {}  # hub name -> stored name
        for stored in ckpt:
            name = stored
            for new, old in _V5_PREFIXES:
                if name.startswith(new):
                    name = old + name[len(new) :]
                    break
            if name.startswith("visual.") == vision:
                self._names[name] = stored

    def __getitem__(self, name: str) -> Any:
        return self._ckpt[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def is_qwen2_vl_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose config.json is a Qwen2-VL one (model_type or architectures)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return False
    try:
        d = json.loads(config_path.read_text())
    except ValueError:
        return False
    return d.get("model_type") == "qwen2_vl" or "Qwen2VLForConditionalGeneration" in (d.get("architectures") or ())


def read_qwen2_vl_config(model_dir: str | os.PathLike) -> Qwen2VLConfig:
    """config.json as a Qwen2VLConfig, generation_config.json's extra stop ids merged into the text config."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {str(model_dir)!r}: expected a Hugging Face Qwen2-VL directory")
    cfg = Qwen2VLConfig.from_hf_config(json.loads(config_path.read_text()))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        extra = tuple(int(i) for i in gen_eos if i not in cfg.text.eos_token_ids)
        if extra:
            text = dataclasses.replace(cfg.text, eos_token_ids=cfg.text.eos_token_ids + extra)
            cfg = dataclasses.replace(cfg, text=text)
    return cfg


def abstract_qwen2_vl(
    cfg: Qwen2VLConfig, *, dtype, attention_fn: AttentionFn, fp32_matmul_precision: str = "highest"
) -> Qwen2VLForConditionalGeneration:
    """The whole model with shapes only (dummy weights fill it)."""
    return nnx.eval_shape(
        lambda: Qwen2VLForConditionalGeneration.build(
            cfg, dtype=dtype, param_dtype=dtype, attention_fn=attention_fn, rngs=nnx.Rngs(0),
            fp32_matmul_precision=fp32_matmul_precision,
        )
    )  # fmt: skip


def load_qwen2_vl(
    model_dir: str | os.PathLike, *, dtype, attention_fn: AttentionFn, fp32_matmul_precision: str = "highest",
    shardings_fn=None, progress: bool = False,
) -> tuple[Qwen2VLForConditionalGeneration, Qwen2VLConfig]:
    """``shardings_fn`` places the decoder's weights as they load (the tower's are replicated by the runner)."""
    model_dir = Path(model_dir)
    cfg = read_qwen2_vl_config(model_dir)
    with SafetensorsCheckpoint(model_dir) as ckpt:
        language = load_from_hf_tensors(
            cfg.text, _Part(ckpt, vision=False), dtype=dtype, attention_fn=attention_fn,
            fp32_matmul_precision=fp32_matmul_precision, shardings_fn=shardings_fn, progress=progress,
        )  # fmt: skip
        precision = matmul_precision(dtype, fp32_matmul_precision)
        # Shapes only (no random init of 0.6 B parameters to overwrite); every one is set below or it raises.
        visual = nnx.eval_shape(
            lambda: Qwen2VisionTransformer(
                cfg.vision, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0), precision=precision
            )
        )
        load_vision_weights(visual, _Part(ckpt, vision=True), prefix="visual.")
    return Qwen2VLForConditionalGeneration(cfg, visual, language), cfg
