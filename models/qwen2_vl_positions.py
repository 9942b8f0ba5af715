"""Multimodal rotary positions (M-RoPE) of a Qwen2-VL prompt: three rows (temporal, height, width) per token.

Host-side numpy, computed once per request when it is added: text tokens count up on all three rows;
an image's placeholder tokens (one per merged 2x2 patch window) take (start, start + row, start + col) of
their window, and the text after the image resumes at start + max(rows, cols). Tokens past the prompt
(generated ones) use ``i + delta`` on all three rows, ``delta`` being what this returns with the rows:
the same numbers as transformers' ``Qwen2VLModel.get_rope_index``.
"""

from __future__ import annotations

import numpy as np


def mrope_positions(
    input_ids: np.ndarray,  # [L] int
    image_grid_thw: np.ndarray | None,  # [I, 3] (t, h, w) in patches, one row per image in prompt order
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:  # (positions [3, L] int32, delta: generated token i sits at i + delta)
    ids = np.asarray(input_ids).reshape(-1)
    grids = np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw, np.int64)
    m = spatial_merge_size
    sizes = [int(t * (h // m) * (w // m)) for t, h, w in grids.tolist()]
    is_image = ids == image_token_id
    if int(is_image.sum()) != sum(sizes):
        raise ValueError(
            f"the prompt has {int(is_image.sum())} image tokens but image_grid_thw={grids.tolist()} needs "
            f"{sum(sizes)} (one per {m}x{m} patch window); were the placeholders expanded for these images?"
        )
    pieces, cur, i = [], 0, 0
    for (t, h, w), size in zip(grids.tolist(), sizes):
        start = i + int(np.argmax(is_image[i:]))  # the image's first placeholder token
        text = start - i
        pieces.append(np.broadcast_to(np.arange(text) + cur, (3, text)))
        cur += text
        if not is_image[start : start + size].all():
            raise ValueError(f"image tokens at {start}..{start + size} are not contiguous; an image's tokens must be")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
        pieces.append(np.stack([tt, hh, ww]).reshape(3, -1) + cur)
        cur += max(h, w) // m
        i = start + size
    pieces.append(np.broadcast_to(np.arange(len(ids) - i) + cur, (3, len(ids) - i)))
    positions = np.concatenate(pieces, axis=1).astype(np.int32)  # [3, L]
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta


def mrope_decode_positions(token_positions: np.ndarray, delta: int) -> np.ndarray:
    """Rows for tokens after the prompt: [T] 1-D positions -> [3, T], each ``position + delta``."""
    return np.broadcast_to(np.asarray(token_positions, np.int32) + delta, (3, len(token_positions))).copy()
