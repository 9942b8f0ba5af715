"""The vision side of a vision-language model's runner: the encoder cache and the vision step.

Image embeddings live in one device buffer, ``pool [P, D]`` (the model's dtype), which every text step
of a vision-language model takes whole; each token's ``embed_index`` (row of the pool, -1 for text)
picks its image row inside the step. So the text step has one shape per token bucket, whatever the
images, and a prefill chunk may start or end anywhere inside an image.

The encoder cache maps an image's content hash to the pool rows of its embeddings. An image is encoded
once, by the first step that computes any of its placeholder tokens (its own jitted call, padded to a
power-of-two bucket of patch rows, writing the rows into the donated pool), and stays while requests
still have its tokens to compute; then it waits in LRU order, so the same image in a later request
(or a preempted request's recompute) is not encoded again until its rows are needed for another.

M-RoPE rows travel beside ``embed_index`` in one int32 array ``[4, T]`` (temporal, height, width,
embed_index): prompt tokens take their request's precomputed rows, later tokens ``p + delta``, text-only
requests ``p`` on all three rows.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.qwen2_vl_vision import vision_inputs

logger = logging.getLogger("jaxserve")

_MIN_PATCH_BUCKET = 64


def patch_bucket(num_patches: int) -> int:
    """Patch rows of the encoder call for an image of ``num_patches`` rows: a power of two >= 64."""
    return max(_MIN_PATCH_BUCKET, 1 << (num_patches - 1).bit_length())


def pool_rows(max_num_batched_tokens: int, max_tokens_per_image: int) -> int:
    """Rows of the embedding pool: a step's images (up to two partly computed per sequence end) with room
    to keep recent ones. A multiple of 256."""
    rows = max(4 * max_num_batched_tokens, 2 * max_tokens_per_image, 1024)
    return -(-rows // 256) * 256


def _encode(graphdef, treedef, params, pixels, positions, image_ids, dest, pool):
    """(pixels [N, C*Tp*P*P], positions [N, 2], image_ids [N], dest [N / m**2]) -> pool with the image's
    rows written at ``dest`` (out-of-range entries, for padding rows, dropped)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    rows = model.encode_images(pixels, positions, image_ids)  # [N / m**2, D]
    return pool.at[dest].set(rows.astype(pool.dtype), mode="drop")


@dataclasses.dataclass
class _Entry:
    rows: np.ndarray  # [num_tokens] int32: pool rows of the image's embeddings
    holders: set  # request ids that still have tokens of this image to compute


class VisionRunner:
    """Owns the embedding pool and the encoder cache; builds each step's ``mm_fields [4, T]``."""

    def __init__(self, runner, vl_config, num_rows: int, param_shardings, replicated) -> None:
        self.runner = runner  # for its params, graphdef and (with enforce_eager) its eager model
        self.merge = vl_config.vision.spatial_merge_size
        self.num_rows = num_rows
        self.pool = jax.device_put(jnp.zeros((num_rows, vl_config.text.hidden_size), runner.dtype), replicated)
        self.entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # LRU order
        self.free_rows: list[int] = list(range(num_rows - 1, -1, -1))
        self._pinned: set[bytes] = set()  # images the step being built reads: never evicted for it
        self._encode = jax.jit(
            functools.partial(_encode, runner.graphdef, runner._treedef),
            donate_argnums=5,
            in_shardings=(param_shardings,) + (replicated,) * 5,
            out_shardings=replicated,
        )
        self.compiled_buckets: set[int] = set()
        self.num_encoded = 0  # images run through the tower (cache misses)
        self.num_cache_hits = 0  # image lookups served by the encoder cache

    def info(self) -> dict:
        return {"pool_rows": self.num_rows, "images_encoded": self.num_encoded,
                "encoder_cache_hits": self.num_cache_hits, "patch_buckets_compiled": sorted(self.compiled_buckets)}

    @property
    def pool_bytes(self) -> int:
        return self.pool.size * self.pool.dtype.itemsize

    # ------------------------------------------------------------------ step inputs

    def step_fields(self, seqs, positions: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
        """[4, T] int32 for one step: M-RoPE rows and the pool row of each token (-1 for text and padding).
        Encodes (dispatches) every image this step reads that is not cached yet."""
        t = positions.shape[0]
        fields = np.zeros((4, t), np.int32)
        fields[:3] = positions[None, :]
        fields[3] = -1
        self._pinned = set()
        for i, seq in enumerate(seqs):
            mm = seq.mm
            if mm is None:
                continue
            lo, n = int(query_start_loc[i]), len(seq.token_ids)
            start, end = seq.start_pos, seq.start_pos + n
            if start >= mm.mrope_positions.shape[1]:  # past the prompt (every decode): p + delta, no image
                fields[:3, lo : lo + n] += mm.mrope_delta
                continue
            fields[:3, lo : lo + n] = mm.rope_rows(positions[lo : lo + n])
            for img in mm.images:
                first, last = img.offset, img.offset + img.num_tokens
                if first >= end or last <= start:
                    continue
                rows = self._lookup(img)
                a, b = max(first, start), min(last, end)
                fields[3, lo + a - start : lo + b - start] = rows[a - first : b - first]
                entry = self.entries[img.hash]
                if last <= end:
                    entry.holders.discard(seq.req_id)  # this request's prefill is past the image
                else:
                    entry.holders.add(seq.req_id)
        return fields

    def _lookup(self, img) -> np.ndarray:
        """The image's pool rows, encoding it first on a miss."""
        entry = self.entries.get(img.hash)
        self._pinned.add(img.hash)
        if entry is not None:
            self.entries.move_to_end(img.hash)
            self.num_cache_hits += 1
            return entry.rows
        rows = self._allocate(img.num_tokens)
        self.entries[img.hash] = _Entry(rows, set())
        self._encode_image(img, rows)
        return rows

    def _allocate(self, n: int) -> np.ndarray:
        while len(self.free_rows) < n:
            victim = next((h for h, e in self.entries.items() if not e.holders and h not in self._pinned), None)
            if victim is None:  # every idle one is gone: take one still wanted (it is re-encoded when needed)
                victim = next((h for h in self.entries if h not in self._pinned), None)
            if victim is None:
                raise RuntimeError(
                    f"the images one step reads need more than the encoder cache's {self.num_rows} rows; "
                    "lower --max-num-batched-tokens or --limit-mm-per-prompt, or send smaller images"
                )
            self.free_rows.extend(self.entries.pop(victim).rows.tolist())
        rows = np.array(self.free_rows[-n:], np.int32)
        del self.free_rows[-n:]
        return rows

    # ------------------------------------------------------------------ the vision step

    def _encode_image(self, img, rows: np.ndarray) -> None:
        n = img.pixel_values.shape[0]
        bucket = patch_bucket(n)
        positions, image_ids = vision_inputs(np.asarray([img.grid_thw]), self.merge)
        pixels = np.zeros((bucket, img.pixel_values.shape[1]), np.float32)
        pixels[:n] = img.pixel_values
        pos = np.zeros((bucket, 2), np.int32)
        pos[:n] = positions
        ids = np.full(bucket, -1, np.int32)
        ids[:n] = image_ids
        dest = np.full(bucket // self.merge**2, self.num_rows, np.int32)  # out of range: padding rows dropped
        dest[: len(rows)] = rows
        eager = self.runner._eager_model
        if eager is not None:
            out = eager.encode_images(jnp.asarray(pixels), jnp.asarray(pos), jnp.asarray(ids))
            self.pool = self.pool.at[jnp.asarray(dest)].set(out.astype(self.pool.dtype), mode="drop")
        else:
            if bucket not in self.compiled_buckets:
                logger.info("compiling the vision step for %d patch rows on first use", bucket)
                self.compiled_buckets.add(bucket)
            self.pool = self._encode(self.runner.params, pixels, pos, ids, dest, self.pool)
        self.num_encoded += 1

    def dummy_fields(self, t: int) -> np.ndarray:
        """A padding-only step's [4, T] (warm-up): text rows, no image."""
        fields = np.zeros((4, t), np.int32)
        fields[3] = -1
        return fields
