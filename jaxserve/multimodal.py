"""A vision-language prompt on the host: images -> pixel rows, placeholders expanded, M-RoPE rows.

Once per request, when it is added (no JAX here); the pixel rows are computed on background threads
(``MultiModalProcessor._background_pixels``) and waited for only when the vision step encodes the image. The prompt marks each image with one
``<|image_pad|>`` token (Qwen2-VL's chat template writes ``<|vision_start|><|image_pad|><|vision_end|>``);
it is expanded to one token per merged patch window of that image (``t * h * w / merge**2``), so the
prompt's length is what the decoder computes. A prompt whose placeholders are already expanded (token ids
from HF's processor) is taken as it is.

Every image is keyed by a SHA-256 of its decoded pixels: the encoder cache (the runner computes an image's
embeddings once while requests need them) and the prefix cache (jaxserve.block_hash) both use it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
from typing import Any, Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a prompt, preprocessed."""

    hash: bytes  # 32 bytes: SHA-256 of the decoded image (mode, size, pixels)
    pixels: Any  # the pixel rows below, or a Future of them (computed in the background)
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches
    offset: int  # index of the image's first placeholder token in the prompt
    num_tokens: int  # placeholder tokens: N // merge**2

    @property
    def pixel_values(self) -> np.ndarray:
        """[N, C*Tp*P*P] float32: N patch rows, in the processor's merge-window order (waits for them)."""
        return self.pixels.result() if isinstance(self.pixels, concurrent.futures.Future) else self.pixels

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclasses.dataclass(frozen=True, eq=False)
class MultiModalInputs:
    """What a request's images add to its prompt."""

    images: tuple[ImageItem, ...]
    mrope_positions: np.ndarray  # [3, L] int32: the prompt's (temporal, height, width) rotary rows
    mrope_delta: int  # a token at 1-D position p >= L sits at p + delta on all three rows

    def rope_rows(self, positions: np.ndarray) -> np.ndarray:
        """[n] 1-D positions -> [3, n] M-RoPE rows (prompt rows, or p + delta past the prompt)."""
        length = self.mrope_positions.shape[1]
        in_prompt = positions < length
        rows = self.mrope_positions[:, np.minimum(positions, length - 1)]
        return np.where(in_prompt[None, :], rows, positions[None, :] + self.mrope_delta).astype(np.int32)


def image_hash(image: Any) -> bytes:
    """SHA-256 of a PIL image's mode, size and pixels (or an array's dtype, shape and bytes)."""
    h = hashlib.sha256()
    if isinstance(image, np.ndarray):
        h.update(f"{image.dtype}{image.shape}".encode())
        h.update(np.ascontiguousarray(image).tobytes())
    else:
        h.update(f"{image.mode}{image.size}".encode())
        h.update(image.tobytes())
    return h.digest()


class MultiModalProcessor:
    """Turns (prompt ids, images) into (expanded ids, MultiModalInputs) for one Qwen2-VL checkpoint."""

    def __init__(self, model_dir: Optional[str], vl_config, limit_mm_per_prompt: Optional[dict] = None,
                 mm_processor_kwargs: Optional[dict] = None):  # fmt: skip
        from jaxserve.models.qwen2_vl_image import Qwen2VLImageProcessor

        preprocessor = None
        path = os.path.join(model_dir, "preprocessor_config.json") if model_dir else None
        if path and os.path.isfile(path):
            with open(path) as f:
                preprocessor = json.load(f)
        self.image_processor = Qwen2VLImageProcessor(preprocessor, **(mm_processor_kwargs or {}))
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # background preprocessing
        self.config = vl_config
        self.image_token_id = vl_config.image_token_id
        self.merge = vl_config.vision.spatial_merge_size
        self.max_images = int((limit_mm_per_prompt or {}).get("image", 1 << 30))
        hf = self.image_processor._hf
        max_pixels = getattr(hf, "max_pixels", None) or (getattr(hf, "size", None) or {}).get("longest_edge")
        unit = vl_config.vision.patch_size * self.merge
        # The most placeholder tokens one image can take (the processor resizes within max_pixels).
        self.max_tokens_per_image = int(max_pixels) // unit**2 if max_pixels else 16384

    def process(self, prompt_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], Optional[MultiModalInputs]]:
        ids = list(prompt_ids)
        count = sum(1 for t in ids if t == self.image_token_id)
        if not images:
            if count:
                raise ValueError(
                    f"the prompt has {count} image placeholder token(s) (id {self.image_token_id}) but no image was "
                    "given: pass the images as multi_modal_data={'image': [...]} (or image parts in chat messages)"
                )
            return ids, None
        if len(images) > self.max_images:
            raise ValueError(
                f"{len(images)} images in one prompt exceed limit_mm_per_prompt={{'image': {self.max_images}}}; "
                f"send at most {self.max_images} or raise --limit-mm-per-prompt image=N"
            )
        images = [_as_rgb(im, i) for i, im in enumerate(images)]
        proc = self.image_processor
        if proc.grids_known_early:  # raises here, on the caller's thread, for a bad size
            grids = np.asarray([proc.grid_thw(im) for im in images], np.int64)  # [I, 3]
            pixels = self._background_pixels(images, grids)
        else:  # the processor's grids are not known without running it: run it now
            flat, grids = proc(images)  # [N_all, C*Tp*P*P], [I, 3]
            pixels = np.split(flat, np.cumsum(np.prod(grids, axis=1))[:-1])
        sizes = self.image_processor.num_image_tokens(grids)
        ids = self._expand(ids, count, sizes)
        from jaxserve.models.qwen2_vl_positions import mrope_positions

        rope, delta = mrope_positions(
            np.asarray(ids), grids, image_token_id=self.image_token_id, spatial_merge_size=self.merge
        )
        items, start = [], 0
        for image, grid, pix, size in zip(images, grids.tolist(), pixels, sizes):
            offset = ids.index(self.image_token_id, start)
            items.append(ImageItem(image_hash(image), pix, tuple(grid), offset, size))
            start = offset + size
        return ids, MultiModalInputs(tuple(items), rope, delta)

    def _background_pixels(self, images: list, grids: np.ndarray) -> list:
        """Futures of each image's pixel rows, computed on this processor's threads while the engine runs: the
        placeholders were counted from the image sizes alone (``grid_thw``), and the vision step waits for the
        rows only when it encodes the image. Preprocessing is ~10 ms of host time an image (resize, normalise,
        patchify), which would otherwise all come before the first step."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="jaxserve-image"
            )
        proc = self.image_processor
        return [self._pool.submit(_pixels_of, proc, im, tuple(g)) for im, g in zip(images, grids.tolist())]

    def _expand(self, ids: list[int], count: int, sizes: list[int]) -> list[int]:
        """One placeholder per image -> ``sizes[i]`` of them; already-expanded runs are kept."""
        runs = _runs(ids, self.image_token_id)
        if [n for _, n in runs] == sizes:
            return ids  # already expanded (ids from HF's processor)
        if count != len(sizes) or any(n != 1 for _, n in runs):
            raise ValueError(
                f"the prompt has {count} image placeholder token(s) (id {self.image_token_id}) for {len(sizes)} "
                f"image(s): put one '<|vision_start|><|image_pad|><|vision_end|>' in the prompt per image, in order"
            )
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_token_id:
                out.extend([t] * sizes[k])
                k += 1
            else:
                out.append(t)
        return out


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of ``token``."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _pixels_of(processor, image, grid: tuple[int, int, int]) -> np.ndarray:
    """One image's pixel rows, checked against the grid its placeholders were counted from."""
    pixels, grids = processor([image])
    if tuple(int(x) for x in grids[0]) != tuple(grid):
        raise RuntimeError(f"the image processor gave grid {grids[0].tolist()} where {list(grid)} was expected")
    return pixels


def _as_rgb(image: Any, index: int):
    """A PIL image in RGB (the processor's input); arrays [H, W, 3] uint8 become images."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
            raise ValueError(f"image {index}: an array image must be [H, W, 3] uint8, got {image.dtype}{image.shape}")
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise ValueError(
            f"image {index}: expected a PIL.Image.Image or an [H, W, 3] uint8 array, got {type(image).__name__}"
        )
    if image.width < 1 or image.height < 1:
        raise ValueError(f"image {index} is empty ({image.width}x{image.height} pixels)")
    image.load()  # decoded here, once: the pixels are computed on another thread, the hash on this one
    return image if image.mode == "RGB" else image.convert("RGB")


def images_of(multi_modal_data: Any) -> list[Any]:
    """``{"image": img or [imgs]}`` -> [imgs]; other modalities are an error naming what works."""
    if multi_modal_data is None:
        return []
    if not isinstance(multi_modal_data, dict):
        raise ValueError(
            f"multi_modal_data must be a dict like {{'image': image}}, got {type(multi_modal_data).__name__}"
        )
    other = sorted(set(multi_modal_data) - {"image"})
    if other:
        raise ValueError(f"multi_modal_data has {other}: only 'image' is supported")
    images = multi_modal_data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def parse_limit_mm_per_prompt(value: Any) -> Optional[dict]:
    """``{"image": 2}``, a JSON string of it, or the CLI's ``image=2`` -> ``{"image": 2}``."""
    if value is None or isinstance(value, dict):
        limits = value
    else:
        text = str(value).strip()
        if text.startswith("{"):
            limits = json.loads(text)
        else:
            limits = {}
            for part in filter(None, text.split(",")):
                key, _, n = part.partition("=")
                if not n.strip().isdigit():
                    raise ValueError(f"limit_mm_per_prompt={value!r} is invalid: write image=N (e.g. image=2)")
                limits[key.strip()] = int(n)
    if limits is None:
        return None
    for key, n in limits.items():
        if key != "image":
            raise ValueError(f"limit_mm_per_prompt has {key!r}: only 'image' is supported")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"limit_mm_per_prompt={{'image': {n!r}}} is invalid: must be an integer >= 0")
    return dict(limits)
