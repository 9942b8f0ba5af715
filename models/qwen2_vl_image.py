"""Qwen2-VL image preprocessing: images -> (pixel_values [N, C*Tp*P*P] float32, image_grid_thw [I, 3]).

Choice: transformers' own processor, its PIL/numpy backend (``Qwen2VLImageProcessorPil`` in transformers 5,
the then numpy-only ``Qwen2VLImageProcessor`` in 4.x). It imports neither torch nor torchvision, so the
serving run time stays torch-free, and it is what transformers itself falls back to without torchvision:
``pixel_values`` and ``image_grid_thw`` are HF's by construction (smart resize to a multiple of
patch * merge within ``min_pixels`` / ``max_pixels``, bicubic, rescale, normalise, patchify in merge-window
order). Needs Pillow. Host-side, once per image when a request is added; nothing here touches JAX.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional, Sequence

import numpy as np

try:  # transformers >= 5: the torch-free backend has its own class
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil as _HFImageProcessor,
    )
except ImportError:  # transformers 4.x: the default ("slow") processor is numpy + PIL already
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as _HFImageProcessor


class Qwen2VLImageProcessor:
    """Wraps the HF processor built from a checkpoint's preprocessor_config.json dict (or defaults)."""

    def __init__(self, preprocessor_config: Mapping[str, Any] | None = None, **overrides):
        skip = ("image_processor_type", "processor_class")
        kw = {k: v for k, v in dict(preprocessor_config or {}).items() if k not in skip}
        kw.update({k: v for k, v in overrides.items() if v is not None})  # e.g. min_pixels=, max_pixels=
        self._hf = _HFImageProcessor(**kw)
        self.merge_size = int(self._hf.merge_size)
        self._smart_resize = getattr(sys.modules[type(self._hf).__module__], "smart_resize", None)
        self.grids_known_early = self._check_grid_thw()

    def __call__(self, images: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """PIL images (or HWC uint8 arrays) -> (pixel_values [N, C*Tp*P*P] float32, image_grid_thw [I, 3] int64)."""
        if not len(images):
            raise ValueError("no images to preprocess")
        out = self._hf(images=list(images), return_tensors="np")
        return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64)

    def grid_thw(self, image) -> Optional[tuple[int, int, int]]:
        """(t, h, w) in patches that the processor will give one RGB PIL image, from its size alone (the same
        ``smart_resize``), so the placeholders can be counted before the pixels are computed; None where the
        processor's settings are not the ones this knows (no resize, an unknown version)."""
        hf = self._hf
        if self._smart_resize is None or not getattr(hf, "do_resize", True):
            return None
        size = getattr(hf, "size", None) or {}
        get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k, None))
        min_pixels = getattr(hf, "min_pixels", None) or get("shortest_edge")
        max_pixels = getattr(hf, "max_pixels", None) or get("longest_edge")
        if not (min_pixels and max_pixels):
            return None
        patch = int(hf.patch_size)
        h, w = self._smart_resize(
            image.height, image.width, factor=patch * self.merge_size, min_pixels=min_pixels, max_pixels=max_pixels
        )  # fmt: skip
        return 1, h // patch, w // patch

    def _check_grid_thw(self) -> bool:
        """Whether ``grid_thw`` agrees with the processor itself on a few sizes (checked once, ~20 ms)."""
        from PIL import Image

        try:
            for w, h in ((448, 448), (37, 53), (1000, 301)):
                image = Image.new("RGB", (w, h))
                if self.grid_thw(image) != tuple(int(x) for x in self(([image]))[1][0]):
                    return False
        except Exception:  # noqa: BLE001 - any surprise: compute the pixels up front, as the processor is called
            return False
        return True

    def num_image_tokens(self, image_grid_thw: np.ndarray) -> list[int]:
        """Placeholder tokens per image: one per merge window of its patch grid."""
        return [int(t * h * w) // self.merge_size**2 for t, h, w in np.asarray(image_grid_thw).tolist()]
