"""The vision side of a vision-language model's runner: the encoder cache and the vision step.

Image embeddings live in one device buffer, ``pool [P, D]`` (the model's dtype), which every text step
of a vision-language model takes whole; each token's ``embed_index`` (row of the pool, -1 for text)
picks its image row inside the step. So the text step has one shape per token bucket, whatever the
images, and a prefill chunk may start or end anywhere inside an image.

The encoder cache maps an image's content hash to the pool rows of its embeddings. An image is encoded
once, by the first step that computes any of its placeholder tokens, and stays while requests
still have its tokens to compute; then it waits in LRU order, so the same image in a later request
(or a preempted request's recompute) is not encoded again until its rows are needed for another.

A step's cache misses are encoded together once its fields are built: grouped by patch bucket (a power
of two >= 64 rows), each group in calls of ``[B, N]`` slots (B a power of two, up to _MAX_BATCH_ROWS patch
rows a call; empty slots have image id -1 and pool rows out of range, so they are dropped), each call
writing its rows into the donated pool. One 448x448 image (1024 patch rows) alone leaves an H200's
matmuls latency-bound (~6.8 ms each on Qwen2-VL-7B's tower); eight in one call are one big matmul.

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
# Patch rows of one vision call: B <= this // N. Bounds the call's transient memory (attention scores
# [B, Hv, N, N] float32: 512 MiB for eight 1024-row images of Qwen2-VL-7B) while its matmuls are full.
_MAX_BATCH_ROWS = 8192


def patch_bucket(num_patches: int) -> int:
    """Patch rows of the encoder call for an image of ``num_patches`` rows: a power of two >= 64."""
    return max(_MIN_PATCH_BUCKET, 1 << (num_patches - 1).bit_length())


def pool_rows(max_num_batched_tokens: int, max_tokens_per_image: int) -> int:
    """Rows of the embedding pool: a step's images (up to two partly computed per sequence end) with room
    to keep recent ones. A multiple of 256."""
    rows = max(4 * max_num_batched_tokens, 2 * max_tokens_per_image, 1024)
    return -(-rows // 256) * 256


def _encode(graphdef, treedef, params, pixels, positions, image_ids, dest, pool):
    """(pixels [B, N, C*Tp*P*P], positions [B, N, 2], image_ids [B, N], dest [B, N / m**2]) -> pool with
    the images' rows written at ``dest`` (out-of-range entries, for padding rows and slots, dropped)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    return _scatter(pool, dest, model.encode_images(pixels, positions, image_ids))


def _scatter(pool, dest, rows):
    """pool [P, D] with rows [B, M, D] written at dest [B, M] (out-of-range entries dropped)."""
    return pool.at[dest.reshape(-1)].set(rows.reshape(-1, rows.shape[-1]).astype(pool.dtype), mode="drop")


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
        self._misses: list = []  # (ImageItem, pool rows) the step being built must encode
        self._encode = jax.jit(
            functools.partial(_encode, runner.graphdef, runner._treedef),
            donate_argnums=5,
            in_shardings=(param_shardings,) + (replicated,) * 5,
            out_shardings=replicated,
        )
        self.compiled_buckets: set[tuple[int, int]] = set()  # (B, N) shapes of the vision call
        self.num_encoded = 0  # images run through the tower (cache misses)
        self.num_encode_calls = 0  # vision calls (each up to B images)
        self.num_cache_hits = 0  # image lookups served by the encoder cache

    def info(self) -> dict:
        return {"pool_rows": self.num_rows, "images_encoded": self.num_encoded, "vision_calls": self.num_encode_calls,
                "encoder_cache_hits": self.num_cache_hits,
                "vision_shapes_compiled": [list(k) for k in sorted(self.compiled_buckets)]}  # fmt: skip

    @property
    def pool_bytes(self) -> int:
        return self.pool.size * self.pool.dtype.itemsize

    # ------------------------------------------------------------------ step inputs

    def step_fields(self, seqs, positions: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
        """[4, T] int32 for one step: M-RoPE rows and the pool row of each token (-1 for text and padding).
        Encodes (dispatches) every image this step reads that is not cached yet."""
        t, s = positions.shape[0], len(seqs)
        fields = np.empty((4, t), np.int32)
        fields[:3] = positions[None, :]
        fields[3] = -1
        # A request past its prompt (every decode) sits at p + delta on all three rows and reads no image:
        # one per-sequence delta [S], repeated over its tokens, so a decode step makes no numpy call per
        # sequence (128 of them took 0.18 ms a step on CPU; now 16 us). Text requests add 0; prompt chunks
        # are written whole below.
        deltas = np.zeros(s, np.int32)  # [S]
        in_prompt = []  # indices of vision-language requests with prompt tokens in this step
        for i, seq in enumerate(seqs):
            mm = seq.mm
            if mm is not None:
                if seq.start_pos < mm.mrope_positions.shape[1]:
                    in_prompt.append(i)
                else:
                    deltas[i] = mm.mrope_delta
        if deltas.any():
            fields[:3, : query_start_loc[s]] += np.repeat(deltas, np.diff(query_start_loc[: s + 1]))
        self._pinned, self._misses = set(), []
        try:
            self._prompt_fields(seqs, in_prompt, positions, query_start_loc, fields)
        except BaseException:  # e.g. the pool is too small: forget the entries whose rows were never written
            for img, rows in self._misses:
                self.entries.pop(img.hash, None)
                self.free_rows.extend(rows.tolist())
            self._misses = []
            raise
        self._encode_misses()
        return fields

    def _prompt_fields(self, seqs, in_prompt: list[int], positions, query_start_loc, fields) -> None:
        """The M-RoPE rows and pool rows of the prompt chunks ``seqs[i] for i in in_prompt``."""
        for i in in_prompt:
            seq, mm = seqs[i], seqs[i].mm
            lo, n = int(query_start_loc[i]), len(seq.token_ids)
            start, end = seq.start_pos, seq.start_pos + n
            fields[:3, lo : lo + n] = mm.rope_rows(positions[lo : lo + n])  # past the prompt too, on recompute
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

    def _lookup(self, img) -> np.ndarray:
        """The image's pool rows; a miss is allocated rows now and encoded with the step's other misses."""
        entry = self.entries.get(img.hash)
        self._pinned.add(img.hash)
        if entry is not None:
            self.entries.move_to_end(img.hash)
            self.num_cache_hits += 1
            return entry.rows
        rows = self._allocate(img.num_tokens)
        self.entries[img.hash] = _Entry(rows, set())
        self._misses.append((img, rows))
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

    def _encode_misses(self) -> None:
        """Encodes the step's misses: grouped by patch bucket, up to _MAX_BATCH_ROWS patch rows a call."""
        groups: dict[int, list] = collections.defaultdict(list)
        for img, rows in self._misses:
            groups[patch_bucket(img.num_patches)].append((img, rows))
        self._misses = []
        for bucket, items in sorted(groups.items()):
            # With enforce_eager every intermediate is its own allocation, outside any program's memory plan: [B,
            # Hv, N, N] scores of 8 images ran a 7B model's headroom out of memory on the H200. One image a call.
            most = 1 if self.runner._eager_model is not None else max(1, _MAX_BATCH_ROWS // bucket)
            for k in range(0, len(items), most):
                self._encode_batch(bucket, items[k : k + most])

    def _encode_batch(self, bucket: int, items: list) -> None:
        """One vision call for ``items`` [(ImageItem, pool rows)], each in a slot of ``bucket`` patch rows."""
        b = 1 << (len(items) - 1).bit_length()  # slots: a power of two, so few shapes compile
        dim = items[0][0].pixel_values.shape[1]
        pixels = np.zeros((b, bucket, dim), np.float32)
        pos = np.zeros((b, bucket, 2), np.int32)
        ids = np.full((b, bucket), -1, np.int32)  # -1: padding rows and empty slots
        dest = np.full((b, bucket // self.merge**2), self.num_rows, np.int32)  # out of range: dropped
        for k, (img, rows) in enumerate(items):
            n = img.num_patches
            positions, image_ids = vision_inputs(np.asarray([img.grid_thw]), self.merge)
            pixels[k, :n] = img.pixel_values
            pos[k, :n] = positions
            ids[k, :n] = image_ids
            dest[k, : len(rows)] = rows
        eager = self.runner._eager_model
        if eager is not None:
            out = eager.encode_images(jnp.asarray(pixels), jnp.asarray(pos), jnp.asarray(ids))  # [B, M, D]
            self.pool = _scatter(self.pool, jnp.asarray(dest), out)
        else:
            if (b, bucket) not in self.compiled_buckets:
                logger.info("compiling the vision step for %d image(s) of %d patch rows on first use", b, bucket)
                self.compiled_buckets.add((b, bucket))
            self.pool = self._encode(self.runner.params, pixels, pos, ids, dest, self.pool)
        self.num_encoded += len(items)
        self.num_encode_calls += 1

    def dummy_fields(self, t: int) -> np.ndarray:
        """A padding-only step's [4, T] (warm-up): text rows, no image."""
        fields = np.zeros((4, t), np.int32)
        fields[3] = -1
        return fields
