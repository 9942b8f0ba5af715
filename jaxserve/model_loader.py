"""Finding and loading a model: an HF directory, a GGUF file, a `jaxserve convert` (orbax) directory,
dummy weights, or the embedded default."""

from __future__ import annotations

import glob
import logging
import os
from typing import Optional

logger = logging.getLogger("jaxserve")


def resolve_model_path(model: Optional[str], load_format: str) -> tuple[str, str]:
    """Returns (path, format) where format is "safetensors" | "gguf" | "orbax" | "dummy"."""
    from jaxserve.models.loader.orbax_format import METADATA_FILE, is_orbax_checkpoint

    if load_format == "orbax" and (model is None or not is_orbax_checkpoint(os.path.expanduser(model))):
        if model is None:
            raise ValueError(
                "load_format='orbax' needs model= a directory written by `jaxserve convert` (`jaxserve convert "
                "OUT_DIR` converts the default model), or use load_format='auto'"
            )
        state = "does not exist" if not os.path.exists(os.path.expanduser(model)) else (
            f"is not a directory written by `jaxserve convert` (no {METADATA_FILE})"
        )
        raise ValueError(
            f"load_format='orbax' but model={model!r} {state}; write it with `jaxserve convert SOURCE {model}` "
            "(SOURCE: an HF directory, a .gguf file, or nothing for the default model), or use load_format='auto'"
        )
    if model is None:
        from jaxserve.models.loader.default_model import default_model_path

        path = default_model_path()
        return path, "dummy" if load_format == "dummy" else "gguf"
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model={model!r} is a file but not a .gguf file; pass a GGUF file or an HF model directory")
        return path, "dummy" if load_format == "dummy" else "gguf"
    if os.path.isdir(path):
        if is_orbax_checkpoint(path):
            if load_format in ("safetensors", "gguf"):
                raise ValueError(
                    f"load_format={load_format!r} but {path} is a jaxserve checkpoint written by `jaxserve convert` "
                    "(orbax weights); use load_format='auto' or 'orbax'"
                )
            return path, "dummy" if load_format == "dummy" else "orbax"
        if os.path.exists(os.path.join(path, "config.json")):
            if load_format == "gguf":
                raise ValueError(f"load_format='gguf' but {path} is a Hugging Face directory (config.json)")
            return path, "dummy" if load_format == "dummy" else "safetensors"
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ggufs[0], "dummy" if load_format == "dummy" else "gguf"
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds several GGUF files ({', '.join(map(os.path.basename, ggufs))}); name one")
        raise ValueError(f"{path} has neither config.json (a Hugging Face model) nor a .gguf file")
    raise ValueError(
        f"model={model!r} was not found on disk. jaxserve loads local models only (no hub downloads): pass a "
        "Hugging Face model directory (config.json + *.safetensors + tokenizer), a .gguf file, a directory written "
        "by `jaxserve convert`, or nothing for the embedded default model"
    )


def load_model(
    path: str, fmt: str, *, dtype, attention_fn, seed: int = 0, shardings_fn=None, fp32_matmul_precision="highest",
    progress: bool = False, quantization: Optional[str] = "none", num_devices: int = 1,
):  # fmt: skip
    """Returns (model, TextModelConfig). ``shardings_fn(abstract_model)`` places parameters as they load (TP);
    ``fp32_matmul_precision`` is how a float32 model's matmuls run (jaxserve.pallas_kernels.precision);
    ``progress`` shows a progress bar over the weights; ``quantization`` (EngineArgs.quantization: "gguf" keeps a
    GGUF file's weights quantized, models/quantized.py; "fp8" quantizes a float checkpoint's projections and head to
    e4m3 once loaded, models/fp8_weights.py, whose products run on ``num_devices`` devices; "none" or None dequantizes
    them)."""
    model, cfg = _load_model(path, fmt, dtype=dtype, attention_fn=attention_fn, seed=seed, shardings_fn=shardings_fn,
                             fp32_matmul_precision=fp32_matmul_precision, progress=progress, quantization=quantization)
    if quantization == "fp8":
        from jaxserve.engine_setup import current_platform
        from jaxserve.models import fp8_weights

        platform = current_platform()
        if platform == "cpu":
            logger.warning("quantization='fp8' on the CPU: every product converts its weight back to a float first, "
                           "~7x slower than float32 (BENCHMARKS §48); on a CPU quantization='gguf' is the fast one")
        fp8_weights.quantize_model(model, fp8_weights.default_mode(platform, num_devices))
    return model, cfg


def _load_model(path, fmt, *, dtype, attention_fn, seed, shardings_fn, fp32_matmul_precision, progress, quantization):
    from jaxserve.models.config import TextModelConfig

    kw = dict(
        dtype=dtype, attention_fn=attention_fn, shardings_fn=shardings_fn, fp32_matmul_precision=fp32_matmul_precision,
        progress=progress,
    )  # fmt: skip

    if quantization == "gguf" and fmt != "gguf":
        raise ValueError(f"quantization='gguf' keeps a GGUF file's weights quantized, but {path!r} is a {fmt} "
                         "checkpoint: leave quantization unset, or serve a .gguf file")
    if fmt in ("safetensors", "dummy") and is_vision_language(path):
        return _load_qwen2_vl(path, fmt, seed=seed, **kw)
    if fmt == "safetensors":
        from jaxserve.models.loader.hf import load_hf_model

        return load_hf_model(path, **kw)
    if fmt == "gguf":
        from jaxserve.models.loader.gguf import read_gguf
        from jaxserve.models.loader.weights import load_from_hf_tensors

        ckpt = read_gguf(path)
        cfg = TextModelConfig.from_hf_config(ckpt.hf_config)
        keep = keeps_quantized(ckpt, quantization)
        model = load_from_hf_tensors(cfg, ckpt.packed_tensors(quantized_weights=keep), quantized_weights=keep, **kw)
        return model, cfg
    if fmt == "orbax":
        from jaxserve.models.loader.orbax_format import read_metadata
        from jaxserve.models.loader.orbax_weights import load_orbax_model

        read_metadata(path)  # a missing or half-written checkpoint fails here, naming the fix
        cfg = read_text_config(path)
        return load_orbax_model(path, cfg, **kw), cfg
    if fmt == "dummy":
        from jaxserve.models.loader.dummy import load_dummy_model

        cfg = read_text_config(path)
        model = load_dummy_model(cfg, seed=seed, **kw)
        return model, cfg
    raise ValueError(f"unknown model format {fmt!r}")


def keeps_quantized(ckpt, quantization: Optional[str]) -> bool:
    """Whether a GGUF checkpoint's weights stay quantized: only when asked for ("gguf"), and then every projection
    and the embedding must be of a type kept quantized (a ValueError names the others)."""
    if quantization != "gguf":
        return False
    unsupported = ckpt.unquantizable_types()
    if unsupported:
        from jaxserve.models.quantized import BLOCK_BYTES

        raise ValueError(f"quantization='gguf': this file's weights include {sorted(unsupported)}, which stay "
                         f"quantized only as {sorted(BLOCK_BYTES)}; leave quantization unset (they are dequantized "
                         "at load)")
    return True


def is_vision_language(path: str) -> bool:
    """Whether ``path`` holds a vision-language checkpoint (Qwen2-VL) rather than a text-only one."""
    from jaxserve.models.loader.qwen2_vl import is_qwen2_vl_dir

    return os.path.isdir(path) and is_qwen2_vl_dir(path)


def _load_qwen2_vl(path: str, fmt: str, *, dtype, attention_fn, seed, shardings_fn, fp32_matmul_precision, progress):
    """(Qwen2VLForConditionalGeneration, its text config). The model carries ``vl_config``, which is how the
    engine knows to run the vision step."""
    from jaxserve.models.loader import qwen2_vl

    if fmt == "dummy":
        from jaxserve.models.loader.dummy import fill_random

        cfg = qwen2_vl.read_qwen2_vl_config(path)
        abstract = qwen2_vl.abstract_qwen2_vl(
            cfg, dtype=dtype, attention_fn=attention_fn, fp32_matmul_precision=fp32_matmul_precision
        )
        return fill_random(abstract, seed=seed, shardings_fn=shardings_fn, progress=progress), cfg.text
    model, cfg = qwen2_vl.load_qwen2_vl(
        path, dtype=dtype, attention_fn=attention_fn, fp32_matmul_precision=fp32_matmul_precision,
        shardings_fn=shardings_fn, progress=progress,
    )  # fmt: skip
    return model, cfg.text


def read_text_config(path: str):
    """The TextModelConfig of an HF or `jaxserve convert` directory (generation_config's stop ids merged) or a
    GGUF file."""
    from jaxserve.models.config import TextModelConfig

    if path.endswith(".gguf"):
        from jaxserve.models.loader.gguf import read_gguf

        return TextModelConfig.from_hf_config(read_gguf(path).hf_config)
    from jaxserve.models.loader.hf import read_hf_config
    from jaxserve.models.loader.orbax_format import is_orbax_checkpoint, read_metadata

    if is_orbax_checkpoint(path):
        read_metadata(path)  # a half-written or newer-format checkpoint fails here, before its config is trusted
    if is_vision_language(path):
        from jaxserve.models.loader.qwen2_vl import read_qwen2_vl_config

        return read_qwen2_vl_config(path).text
    return read_hf_config(path)


# Any one of these makes a directory a tokenizer transformers can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def load_tokenizer(path: str, tokenizer: Optional[str] = None):
    """transformers' fast tokenizer for the model (from its directory, or built from GGUF metadata);
    ``tokenizer`` overrides where it comes from."""
    if tokenizer is not None:
        path = tokenizer
    if path.endswith(".gguf"):
        from jaxserve.models.loader.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        # Fail before transformers does: its search for a tokenizer class imports its model code (and torch
        # where installed), ~10 s of a start-up on a GPU machine, to end in the same error.
        raise ValueError(
            f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); add them, pass tokenizer=..., or run "
            "with skip_tokenizer_init=True and token-id prompts"
        )
    try:
        return _tokenizer_class(path).from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ValueError(
            f"could not load a tokenizer from {path}: {e}. Add tokenizer files to the model directory, pass "
            "tokenizer=..., or run with skip_tokenizer_init=True and token-id prompts"
        ) from e


# tokenizer_config.json's names for transformers' generic fast tokenizer (4.x and 5.x spellings)
_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(path: str):
    """The class AutoTokenizer would pick, imported directly when tokenizer_config.json names the generic fast
    tokenizer (Llama 3, SmolLM2, every `jaxserve convert` of a GGUF): AutoTokenizer's own import costs ~2 s
    of start-up on a 2-core CPU. Anything else goes through AutoTokenizer."""
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in _GENERIC_FAST and os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer
