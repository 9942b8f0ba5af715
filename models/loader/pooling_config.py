"""What an embedding checkpoint declares about its output: pooling, normalisation, Matryoshka dimensions,
and whether a directory holds an embedding model at all (which runner ``runner="auto"`` picks).

Sentence-transformers directories say it in ``modules.json`` (a Transformer, then a Pooling module with
its ``1_Pooling/config.json``, then optionally Normalize); ``sentence_bert_config.json`` gives the
``max_seq_length`` they truncate to. A plain Hugging Face encoder without them gets CLS pooling and a
decoder last-token pooling, both L2-normalised, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

POOLING_TYPES = ("mean", "cls", "last")
_ST_PREFIX = "sentence_transformers.models."
# The 1_Pooling/config.json flags (and the newer "pooling_mode" names) we implement.
_MODE_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_MODE_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_UNSUPPORTED_FLAGS = (
    "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
)


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """How token states become one embedding per input."""

    pooling_type: str  # "mean" | "cls" | "last"
    normalize: bool  # L2-normalise the pooled vector
    max_seq_length: Optional[int] = None  # sentence-transformers' truncation length (caps max_model_len)
    # Matryoshka: None = not trained for truncation (``dimensions`` is refused); () = any size up to the
    # hidden size; else the sizes it was trained for.
    matryoshka_dimensions: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type={self.pooling_type!r} is not supported; supported: {POOLING_TYPES}")


def _read_json(path: str) -> Optional[Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def is_pooling_checkpoint(model_dir: str) -> bool:
    """True when ``model_dir`` holds an embedding model: a sentence-transformers directory, or an HF
    encoder (BERT family), or a bare decoder (``*Model`` architecture without an LM head)."""
    from jaxserve.models.bert import ENCODER_ARCHITECTURES, ENCODER_MODEL_TYPES

    if not os.path.isdir(model_dir):
        return False
    if os.path.isfile(os.path.join(model_dir, "modules.json")):
        return True
    config = _read_json(os.path.join(model_dir, "config.json")) or {}
    if config.get("model_type") in ENCODER_MODEL_TYPES:
        return True
    archs = config.get("architectures") or ()
    return any(a in ENCODER_ARCHITECTURES or (a.endswith("Model") and "For" not in a) for a in archs)


def read_pooling_config(model_dir: str, *, is_encoder: bool) -> PoolingConfig:
    """The checkpoint's pooling, normalisation and truncation (defaults as described above)."""
    config = _read_json(os.path.join(model_dir, "config.json")) or {}
    matryoshka = None
    if config.get("matryoshka_dimensions"):
        matryoshka = tuple(int(d) for d in config["matryoshka_dimensions"])
    elif config.get("is_matryoshka"):
        matryoshka = ()
    st = _read_json(os.path.join(model_dir, "sentence_bert_config.json")) or {}
    max_seq = st.get("max_seq_length")
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if modules is None:
        return PoolingConfig("cls" if is_encoder else "last", True, max_seq, matryoshka)
    kinds = [m.get("type", "").removeprefix(_ST_PREFIX) for m in modules]
    unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise ValueError(
            f"{model_dir}/modules.json has modules {unknown} after the transformer; jaxserve implements only "
            "Transformer, Pooling and Normalize (a Dense projection is not supported yet)"
        )
    pooling_type = "cls" if is_encoder else "last"
    for m in modules:
        if m.get("type", "").removeprefix(_ST_PREFIX) == "Pooling":
            pooling_type = _pooling_type(os.path.join(model_dir, m.get("path", ""), "config.json"))
    return PoolingConfig(pooling_type, "Normalize" in kinds, max_seq, matryoshka)


def _pooling_type(path: str) -> str:
    cfg = _read_json(path)
    if cfg is None:
        raise ValueError(f"modules.json names a Pooling module but {path} is missing")
    if isinstance(cfg.get("pooling_mode"), str):
        mode = cfg["pooling_mode"]
        if mode not in _MODE_NAMES:
            raise ValueError(f"{path}: pooling_mode={mode!r} is not supported; supported: {sorted(_MODE_NAMES)}")
        return _MODE_NAMES[mode]
    chosen = [kind for flag, kind in _MODE_FLAGS.items() if cfg.get(flag)]
    unsupported = [flag for flag in _UNSUPPORTED_FLAGS if cfg.get(flag)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{path}: jaxserve pools with exactly one of {sorted(_MODE_FLAGS)}; this config sets "
            f"{chosen + unsupported or 'none'}"
        )
    return chosen[0]
