"""Load a Hugging Face model directory (config.json + safetensors) into a jaxserve model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxserve.models.config import TextModelConfig
from jaxserve.models.loader.weights import load_from_hf_tensors
from jaxserve.pallas_kernels.attention import AttentionFn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: str | os.PathLike) -> TextModelConfig:
    """The model config of a HF directory, with generation_config.json's extra stop ids merged in
    (Llama 3 instruct models list <|eot_id|> only there)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"no config.json in {str(model_dir)!r}: expected a Hugging Face model directory "
            "(config.json plus model.safetensors or sharded *.safetensors with model.safetensors.index.json)"
        )
    cfg = TextModelConfig.from_hf_config(json.loads(config_path.read_text()))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        extra = tuple(int(i) for i in gen_eos if i not in cfg.eos_token_ids)
        if extra:
            cfg = dataclasses.replace(cfg, eos_token_ids=cfg.eos_token_ids + extra)
    return cfg


class SafetensorsCheckpoint(Mapping[str, np.ndarray]):
    """A lazy name -> numpy tensor view over one or several safetensors files (each lookup reads one
    tensor, memory-mapped). bfloat16 comes back as ml_dtypes' bfloat16 numpy dtype.

    Use as a context manager so the files are closed afterwards.
    """

    def __init__(self, model_dir: str | os.PathLike):
        model_dir = Path(model_dir)
        self._files: dict[str, Path] = {}  # tensor name -> file holding it
        index = model_dir / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            for file in sorted(set(weight_map.values())):
                if not (model_dir / file).is_file():
                    raise FileNotFoundError(f"{INDEX_FILE} in {str(model_dir)!r} lists {file!r}, which is missing")
            self._files = {name: model_dir / file for name, file in weight_map.items()}
        elif (model_dir / SINGLE_FILE).is_file():
            with safe_open(model_dir / SINGLE_FILE, framework="numpy") as f:
                self._files = {name: model_dir / SINGLE_FILE for name in f.keys()}
        else:
            found = sorted(p.name for p in model_dir.iterdir())
            hint = " (PyTorch .bin checkpoints are not read: convert them to safetensors)" if any(
                n.endswith(".bin") for n in found
            ) else ""
            raise FileNotFoundError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {str(model_dir)!r}{hint}; found {found}"
            )
        self.total_bytes = sum(p.stat().st_size for p in set(self._files.values()))
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, Any] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._files[name]
        handle = self._open.get(path)
        if handle is None:
            handle = self._open[path] = self._stack.enter_context(safe_open(path, framework="numpy"))
        return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_hf_model(
    model_dir: str | os.PathLike,
    *,
    dtype,
    attention_fn: AttentionFn,
    shardings_fn: Callable[[nnx.Module], Any] | None = None,
    fp32_matmul_precision: str = "highest",
    progress: bool = False,
) -> tuple[nnx.Module, TextModelConfig]:
    """Build the model of a HF directory with its weights in ``dtype`` on device.

    ``shardings_fn(abstract_model)``, if given, returns a state-shaped tree of shardings that places
    each parameter as it is loaded (for tensor parallelism).
    """
    cfg = read_hf_config(model_dir)
    with SafetensorsCheckpoint(model_dir) as ckpt:
        model = load_from_hf_tensors(
            cfg,
            ckpt,
            dtype=dtype,
            attention_fn=attention_fn,
            shardings_fn=shardings_fn,
            progress=progress,
            fp32_matmul_precision=fp32_matmul_precision,
        )
    return model, cfg
