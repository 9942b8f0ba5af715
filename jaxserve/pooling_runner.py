"""The pooling runner: packs a step's prompts into one flat batch, runs the model, pools on the device.

A step is T flat tokens of S sequences, placed by the scheduler in rows of R tokens (each prompt whole in
one row, end to end with the others there), T padded to the same power-of-two token buckets as the generate
runner and S tied to T (``buckets.seq_bucket_for``), so the number of compiled shapes is the number of token
buckets. Attention runs per row, masked to each token's own sequence (bidirectional for encoders, causal for
decoders); no KV cache exists. The step returns the
pooled vector of every sequence, [S, D] float32: one device-to-host copy of S * D floats, never the [T, D]
hidden states. Truncation to Matryoshka ``dimensions`` and L2 normalisation are per request, on the host.

Tensor parallelism: the runner's ``(1, tp)`` mesh places every parameter by its logical axis names
(jaxserve.sharding's one rules table, as the generate runner does: heads and the MLP split over "model"),
the batch and the pooled rows are replicated, and XLA's partitioner splits the jnp attention and inserts the
all-reduces. A data-parallel replica is one more runner on another mesh row (jaxserve.pooling_engine).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve import buckets, sharding
from jaxserve.models.loader.embedding import EmbeddingModel, hidden_states
from jaxserve.models.loader.pooling_config import PoolingConfig

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class PoolingHandle:
    """A dispatched step: its pooled rows, still on the device, and how many of them are real."""

    pooled: jax.Array  # [S_bucket, D] float32
    num_seqs: int


def _pool_step(graphdef, treedef, is_encoder: bool, pooling_type: str, leaves, tokens, seqs):
    """tokens [4, T] int32 (ids, type ids, positions, seq ids; padding has seq id S), seqs [3, S] int32 (first
    token index, last token index, length) -> pooled [S, D] float32."""
    state = jax.tree.unflatten(treedef, leaves)
    ids, type_ids, positions, seq_ids = tokens[0], tokens[1], tokens[2], tokens[3]
    hidden = hidden_states(graphdef, state, is_encoder, ids, type_ids, positions, seq_ids)  # [T, D]
    num_seqs = seqs.shape[1]
    if pooling_type == "mean":
        summed = jax.ops.segment_sum(hidden.astype(jnp.float32), seq_ids, num_segments=num_seqs)  # [S, D]; pads dropped
        return summed / jnp.maximum(seqs[2], 1).astype(jnp.float32)[:, None]
    index = seqs[0] if pooling_type == "cls" else seqs[1]  # [S]
    return jnp.take(hidden, index, axis=0).astype(jnp.float32)


class PoolingRunner:
    def __init__(
        self, em: EmbeddingModel, pooling: PoolingConfig, *, max_num_batched_tokens: int, max_num_seqs: int,
        precompile: str = "all", mesh: Optional[jax.sharding.Mesh] = None,
    ):  # fmt: skip
        """``em`` was built with the row length the scheduler packs to (a bucket >= it is a multiple of it).
        ``mesh``: this replica's ``(1, tp)`` mesh (default: the first device)."""
        self.pooling = pooling
        self.hidden_size = em.hidden_size
        self.max_num_seqs = max_num_seqs
        self.mesh = mesh if mesh is not None else sharding.replica_meshes(sharding.make_mesh(1))[0]
        graphdef, state = nnx.split(em.model)
        # Where the loader already placed the weights on this mesh, a no-op; another replica gets its own copy.
        state = jax.device_put(state, sharding.param_shardings(em.model, self.mesh))
        self._leaves, treedef = jax.tree.flatten(state)
        # Buckets from 16 tokens: a pooling step is a prefill, never a one-token decode.
        self.token_buckets = buckets.token_buckets(max_num_batched_tokens, platform="accel")
        self.precompile = precompile
        batch = sharding.replicated(self.mesh)  # the packed batch in, the pooled rows out
        self._jitted = jax.jit(
            functools.partial(_pool_step, graphdef, treedef, em.is_encoder, pooling.pooling_type),
            in_shardings=([x.sharding for x in self._leaves], batch, batch), out_shardings=batch,
        )  # fmt: skip
        self._compiled: dict[int, object] = {}
        self.num_steps = 0  # dispatched so far

    def _shapes(self, t: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        s = buckets.seq_bucket_for(t, self.max_num_seqs)
        return jax.ShapeDtypeStruct((4, t), jnp.int32), jax.ShapeDtypeStruct((3, s), jnp.int32)

    def warmup(self, progress: bool = False) -> float:
        """Compile every token bucket (``precompile`` "none": none, they compile on first use)."""
        start = time.perf_counter()
        if self.precompile == "none":
            return 0.0
        for t in tqdm(self.token_buckets, desc="Compiling pooling steps", disable=not progress, leave=False):
            self._compiled[t] = self._jitted.lower(self._leaves, *self._shapes(t)).compile()
        return time.perf_counter() - start

    @property
    def compiled_shapes(self) -> list[int]:
        return sorted(self._compiled)

    def dispatch(self, prompts: list[tuple[list[int], int]]) -> PoolingHandle:
        """Launch one step over ``prompts``, (token ids, flat index of the first) as the scheduler placed them;
        returns at once."""
        end = max(start + len(ids) for ids, start in prompts)
        t = buckets.pick(self.token_buckets, end)
        s = buckets.seq_bucket_for(t, self.max_num_seqs)
        if len(prompts) > s:
            raise ValueError(f"{len(prompts)} prompts exceed the {s} sequences of token bucket {t}")
        tokens = np.zeros((4, t), np.int32)
        tokens[3] = s  # padding: a sequence id of its own, out of range for the pooled rows
        seqs = np.zeros((3, s), np.int32)
        for i, (ids, at) in enumerate(prompts):
            k = len(ids)
            tokens[0, at : at + k] = ids
            tokens[2, at : at + k] = np.arange(k)
            tokens[3, at : at + k] = i
            seqs[:, i] = (at, at + k - 1, k)
        step = self._compiled.get(t)
        if step is None:
            if self.precompile != "none":
                logger.info("compiling the pooling step for %d tokens (first use)", t)
            step = self._jitted
        self.num_steps += 1
        return PoolingHandle(step(self._leaves, tokens, seqs), len(prompts))

    def fetch(self, handle: PoolingHandle) -> np.ndarray:  # [num_seqs, D] float32
        return np.asarray(handle.pooled)[: handle.num_seqs]


def finish_embedding(
    pooled: np.ndarray, *, normalize: bool, dimensions: Optional[int]
) -> np.ndarray:  # [D] -> [dimensions or D]
    """Matryoshka truncation first, then L2 normalisation (so a truncated embedding is unit length too)."""
    v = pooled[:dimensions] if dimensions is not None else pooled
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v
