"""ModelRunner: the only part of the engine that touches the device.

It owns the split model ``(graphdef, state)``, the paged KV cache (donated into every step so XLA
updates it in place), and one jitted step per static shape bucket. Each step: pad the scheduler's
ragged batch to a bucket, run the model, take the logits of each sequence's last token, sample on
device, and copy the sampled tokens back in one transfer.

Dispatch and read-back are separate (``dispatch`` / ``fetch``) so that the engine can dispatch step
N+1 before it reads step N's tokens: the sampled ids stay on the device (``_last_tokens``) and the next
step takes each placeholder input token from them inside the jitted step, so the host never waits for
them. The weights travel into the jitted step as a flat list of arrays, not as the nnx State pytree,
because flattening custom pytree nodes costs Python time on every call.

Sharding: the runner owns one (1, tp) mesh. Parameters, the KV cache (by KV heads) and the step's
inputs and outputs are placed by jaxserve.sharding's rules; the step is jitted with those in/out
shardings, so the donated cache comes back with the sharding it went in with (in place), and XLA adds
the tensor-parallel collectives.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve import buckets, gemm_backend, kv_scale_calibration, launch_mode, prompt_logprobs, sharding
from jaxserve.batch_builder import StepInputs, build_step_inputs
from jaxserve.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from jaxserve.executable_store import ExecutableStore
from jaxserve.kv_cache import allocate_kv_caches, bytes_per_block, num_blocks_for
from jaxserve.pallas_kernels import cpu_native, kv_layout
from jaxserve.pallas_kernels.attention import GATHER_BACKENDS
from jaxserve.pallas_kernels.fp8 import is_fp8, kv_cache_dtype_for, storage_dtype
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.sampler import SamplerOutput, to_runner_output
from jaxserve.sampling_metadata import SamplingMetadata
from jaxserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.structured_output import fill_token_masks
from jaxserve.step_program import (
    dummy_inputs, forward_step, forward_step_with_prompt_logprobs, mm_kwargs, pack_inputs, run_model, sample_padded,
)

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class StepHandle:
    """A dispatched step whose results may still be computing on the device."""

    sampled: Optional[SamplerOutput]  # device arrays (None until ``sample_deferred`` launches a held-back sampler)
    num_rows: int  # real sequences in the step
    prompt_logprobs: Any = None  # PromptLogprobs (device arrays) when some sequence wanted them
    deferred: Any = None  # dispatch(defer_masks=True): (launch the sampler, seqs, SamplingMetadata) until sampled


class ModelRunner:
    """Runs steps of the model over the paged KV cache, padded to precompiled buckets."""

    def __init__(
        self,
        model: nnx.Module,
        text_config,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        runner_config: RunnerConfig,
        mesh: jax.sharding.Mesh | None = None,
        lora_config=None,  # jaxserve.config.LoRAConfig with enable_lora
        mm_max_tokens_per_image: int = 16384,
        aux_hidden: tuple[tuple[int, ...], int, int] | None = None,
    ) -> None:
        """``mm_max_tokens_per_image``: a vision-language model's largest image in placeholder tokens (sizes
        the image-embedding pool). ``aux_hidden`` (EAGLE speculation only): (the target's hidden states an
        EAGLE head reads, their width W, the head's own KV bytes per token): the steps then also write those
        hidden states to a store [num_slots, W] kept after the layer caches; both count in the memory a KV
        block costs."""
        self.text_config = text_config
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.runner_config = runner_config
        self.block_size = cache_config.block_size
        self.mesh = mesh if mesh is not None else sharding.replica_meshes(sharding.make_mesh(1))[0]
        tp = self.mesh.shape["model"]
        # Per-layer fp8 KV scales (static in the graphdef, so constants of the compiled steps): stored programs
        # are keyed by them too.
        vl_config = getattr(model, "vl_config", None)  # a vision-language model (Qwen2-VL)
        layers = getattr(getattr(getattr(model, "language", model), "model", None), "layers", [])
        self.kv_scales = [(getattr(m.self_attn, "k_scale", 1.0), getattr(m.self_attn, "v_scale", 1.0)) for m in layers]
        self.graphdef, state = nnx.split(model)
        # A no-op when the loader already placed the weights (it does, via shardings_fn).
        self.state = jax.device_put(state, sharding.param_shardings(model, self.mesh))
        del state
        self.params, self._treedef = jax.tree.flatten(self.state)  # flat list: cheap to pass per call
        self._eager_model = nnx.merge(self.graphdef, self.state) if runner_config.enforce_eager else None
        # LoRA adapter slots (jaxserve.lora.slots), allocated before the KV cache is sized from the memory left.
        self.lora_config = lora_config
        self.lora = None
        if lora_config is not None:
            self.lora = self._lora_slots(model, lora_config, text_config)
        self.dtype = jnp.dtype(model_config.dtype)
        # The cache's dtype: the model's (auto) or an fp8 one, which halves the bytes of a block, so the same
        # memory budget holds about twice the blocks.
        self.kv_dtype = kv_cache_dtype_for(cache_config.kv_cache_dtype, self.dtype)

        self._pool_rows = self._pool_bytes = 0
        if vl_config is not None:  # the image-embedding pool is allocated after the cache is sized: reserve it
            from jaxserve.vision_runner import pool_rows

            self._pool_rows = pool_rows(scheduler_config.max_num_batched_tokens, mm_max_tokens_per_image)
            self._pool_bytes = self._pool_rows * vl_config.text.hidden_size * self.dtype.itemsize

        self.max_blocks_per_seq = math.ceil(model_config.max_model_len / self.block_size)
        self.token_buckets = buckets.token_buckets(scheduler_config.max_num_batched_tokens, runner_config.platform)
        self.width_buckets = buckets.block_width_buckets(
            self.max_blocks_per_seq, self.block_size, full_width_only=runner_config.attention_backend not in GATHER_BACKENDS
        )

        cfg = text_config
        block_bytes = bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.block_size, self.kv_dtype)
        # What one device holds of a block: 1/tp of its heads, and of the store's columns unless tp does not
        # divide W (the store is then replicated: sharding.logical_spec).
        device_block_bytes = block_bytes // tp
        if aux_hidden:  # the hidden-state store's rows and the EAGLE head's KV live at the same slots
            store_bytes = self.block_size * aux_hidden[1] * self.dtype.itemsize
            block_bytes += store_bytes + self.block_size * aux_hidden[2]
            device_block_bytes += store_bytes if aux_hidden[1] % tp else store_bytes // tp
            device_block_bytes += self.block_size * aux_hidden[2] // tp  # the head's KV: split by its KV heads
        self.num_blocks = num_blocks_for(
            cache_config,
            platform=runner_config.platform,
            # Accelerators budget one device's memory.
            block_bytes=block_bytes if runner_config.platform == "cpu" else device_block_bytes,
            max_model_len=model_config.max_model_len,
            max_num_seqs=scheduler_config.max_num_seqs,
            activation_reserve_bytes=self._activation_reserve_bytes(),
            device=self.mesh.devices.flat[0],
        )
        self.kv_cache_bytes = self.num_blocks * block_bytes
        cache_shape = (self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        # The xla backend's pages are heads-major [N, K, P, D] (pallas_kernels/kv_layout.py says why).
        self.kv_heads_major = kv_layout.heads_major(runner_config.attention_backend)
        k_shape = kv_layout.pages_shape(*cache_shape, self.kv_heads_major)
        cache_sharding = sharding.logical_sharding(self.mesh, sharding.kv_cache_axes(self.kv_heads_major), k_shape)
        # The pallas backend may keep an fp8 cache's V pages token-minor [N, K, D, P] (pallas_kernels/kv_layout.py):
        # its kernels and KV write decide from the same switch and the cache's dtype.
        self.v_token_minor = kv_layout.v_token_minor(self.kv_dtype, runner_config.attention_backend, runner_config.platform)
        v_shape = kv_layout.v_pages_shape(*cache_shape, self.v_token_minor) if self.v_token_minor else k_shape
        v_axes = sharding.V_CACHE_TOKEN_MINOR_AXES if self.v_token_minor else sharding.kv_cache_axes(self.kv_heads_major)
        v_sharding = sharding.logical_sharding(self.mesh, v_axes, v_shape)
        # The arrays' own dtype: kv_dtype, or bf16's bits on CPU (fp8.storage_dtype says why).
        stored_as = storage_dtype(self.kv_dtype, runner_config.platform, runner_config.attention_backend in GATHER_BACKENDS)
        self.kv_caches = allocate_kv_caches(
            cfg.num_hidden_layers, self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim, stored_as,
            sharding=cache_sharding, v_token_minor=self.v_token_minor, v_sharding=v_sharding,
            heads_major=self.kv_heads_major,
        )
        param_shardings = [x.sharding for x in self.params]
        # LoRA: the slot arrays ride at the end of the step's parameter list (arguments, not constants: loading an
        # adapter into a slot recompiles nothing). Without LoRA the step program is exactly the plain one.
        lora_spec = None
        if self.lora is not None:
            param_shardings = param_shardings + self.lora.shardings
            lora_spec = (len(self.params), cfg.num_hidden_layers)
        cache_shardings = [(cache_sharding, v_sharding)] * cfg.num_hidden_layers
        self.aux_layers = aux_hidden[0] if aux_hidden else ()
        if aux_hidden:
            store_shape = (self.num_blocks * self.block_size, aux_hidden[1])
            store_sharding = sharding.logical_sharding(self.mesh, sharding.AUX_STORE_AXES, store_shape)
            self.kv_caches.append(jax.jit(lambda: jnp.zeros(store_shape, self.dtype), out_shardings=store_sharding)())
            cache_shardings = [*cache_shardings, store_sharding]
        batch_sharding = sharding.replicated(self.mesh)  # input ids and the whole AttentionMetadata
        logits_sharding = self._logits_sharding = sharding.logical_sharding(self.mesh, sharding.LOGITS_AXES)
        # Every step's samples are padded to the largest S bucket: the next step reads them in one shape.
        self.max_rows = buckets.seq_bucket_for(self.token_buckets[-1], scheduler_config.max_num_seqs)
        # Pure-decode steps (AttentionMetadata.decode_only) take a cheaper attention path: the GPU kernels skip
        # the prefill kernel's launch (~5 µs x layers per step), the xla backend skips its prompt-token routes.
        # With the pallas backend (GPU; on CPU its kernels run interpreted, in tests) such steps get programs of
        # their own; elsewhere only the 1-token bucket, which can hold nothing but one decode, takes that path
        # (no extra program). The TPU kernel has a single path.
        self.decode_variants = runner_config.attention_backend == "pallas" and runner_config.platform in ("gpu", "cpu")
        self.vision = None  # jaxserve.vision_runner.VisionRunner for a vision-language model
        if vl_config is not None:
            from jaxserve.vision_runner import VisionRunner

            self.vision = VisionRunner(self, vl_config, self._pool_rows, param_shardings, batch_sharding)
        num_mm = 2 if self.vision is not None else 0  # (mm_fields, image pool)
        # Plain steps keep XLA's command buffers, but not in a speculative engine, whose loop launches each step
        # after reading the last (launch_mode). Given to jit, the options reach every compile of these steps.
        self._step_options = launch_mode.compiler_options(runner_config.platform, runner_config.host_bound_steps)
        # Products of one row or a few by the CPU's native kernels, where the step runs on one device (cpu_native.py).
        self.native_products = runner_config.platform == "cpu" and self.mesh.size == 1 and (
            cpu_native.loaded("gemv") or cpu_native.loaded("gemm"))
        self._steps = {
            decode_only: jax.jit(
                functools.partial(
                    forward_step, self.graphdef, self._treedef, self.max_rows, decode_only, lora_spec, self.aux_layers,
                    native_products=self.native_products,
                ),
                donate_argnums=1,
                in_shardings=(param_shardings, cache_shardings) + (batch_sharding,) * (4 + num_mm),
                out_shardings=(logits_sharding, batch_sharding, cache_shardings),
                compiler_options=self._step_options,
            )
            for decode_only in (False, True)
        }
        # Steps that also score prompt tokens (prompt_logprobs.py): one more argument (targets) and output, compiled
        # by jit on first use, since few workloads ask for them.
        self._plp_steps = {
            decode_only: jax.jit(
                functools.partial(
                    forward_step_with_prompt_logprobs, self.graphdef, self._treedef, self.max_rows, decode_only,
                    lora_spec, self.aux_layers, native_products=self.native_products,
                ),
                donate_argnums=1,
                in_shardings=(param_shardings, cache_shardings) + (batch_sharding,) * (5 + num_mm),
                out_shardings=(logits_sharding, batch_sharding, cache_shardings, batch_sharding),
                compiler_options=self._step_options,
            )
            for decode_only in (False, True)
        }
        self._plp_programs: dict[tuple[int, int, bool], Any] = {}  # (T, B, decode_only) -> its program, once used
        self._sample = jax.jit(functools.partial(sample_padded, num_rows_max=self.max_rows))
        self._last_tokens = jax.device_put(np.zeros(self.max_rows, np.int32), batch_sharding)  # [S_max]
        # calculate_kv_scales (kv_scale_calibration.py): the scales travel as one traced [L, 2] array, set from the
        # first step's amax before that step runs; None (no argument, static scales) otherwise.
        self.calculate_kv_scales = cache_config.calculate_kv_scales and is_fp8(self.kv_dtype)
        self._kv_scales_arr = None
        if self.calculate_kv_scales:
            self._kv_scales_arr = jax.device_put(np.ones((len(layers), 2), np.float32), batch_sharding)
        self._calibration_pending = self.calculate_kv_scales
        self.num_steps = 0
        self.compiled_shapes: set[tuple[int, int, bool]] = set()  # (T, B, decode_only) compiled at start-up or since
        self.compile_seconds: dict[tuple[int, int, bool], float] = {}  # start-up compiles' wall seconds, by shape
        self._programs: dict[tuple[int, int, bool], Any] = {}  # (T, B, decode_only) -> compiled step (jax.stages.Compiled)
        self._sampler_programs: dict[tuple, Any] = {}  # _sampler_key -> the start-up's compiled sampler
        self.num_lazy_compiles = 0
        self.num_loaded_programs = 0  # step programs the warm-up read from the executable store

    def _lora_slots(self, model: nnx.Module, lora_config, text_config):
        """The LoRA slots. On one device, with the base kernels in lora_dtype, each group's A is folded into its base
        kernel (models/lora.py: one matmul gives the base output and the shrink, a kernel launch less per
        projection): the step's parameter list then holds empty placeholders where those kernels were, and the
        model's own references to them are dropped, so the base weights are held once."""
        from jaxserve.lora.slots import LoRASlots
        from jaxserve.models.lora import GROUPS

        index = {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(self.state)[0])}
        keys = [
            "['model']['layers'][%d]%s['kernel'].value" % (layer, "".join(f"['{m}']" for m in module.split(".")))
            for layer in range(text_config.num_hidden_layers)
            for _, module in GROUPS.values()
        ]  # fmt: skip
        positions = [index.get(k) for k in keys]
        foldable = (
            self.mesh.size == 1 and self._eager_model is None and None not in positions
            and all(self.params[i].dtype == jnp.dtype(lora_config.lora_dtype) for i in positions)
        )  # fmt: skip
        if not foldable:
            return LoRASlots(lora_config, text_config, self.mesh)
        kernels = [self.params[i] for i in positions]  # LoRASlots empties the list as it folds them
        placeholder = sharding.replicated(self.mesh)
        for i in positions:
            self.params[i] = jax.device_put(np.zeros((0,), self.params[i].dtype), placeholder)
        self.state = jax.tree.unflatten(self._treedef, self.params)
        nnx.update(model, self.state)  # the caller's model must not keep the base kernels alive either
        return LoRASlots(lora_config, text_config, self.mesh, base_kernels=kernels)

    # ------------------------------------------------------------------ sizing

    def _activation_reserve_bytes(self) -> int:
        """A generous bound on one step's temporaries at the largest bucket (accelerators only)."""
        cfg = self.text_config
        t = self.scheduler_config.max_num_batched_tokens
        s = buckets.seq_bucket_for(t, self.scheduler_config.max_num_seqs)
        per_token = 4 * (cfg.hidden_size * 8 + cfg.intermediate_size * 3 + cfg.num_attention_heads * cfg.head_dim * 4)
        logits = 4 * s * cfg.vocab_size * 4
        return int(t * per_token + logits + self._pool_bytes + (512 << 20))

    # ------------------------------------------------------------------ step

    def _shapes_for(self, sched: SchedulerOutput) -> tuple[int, int, int, bool]:
        t = buckets.pick(self.token_buckets, sched.num_batched_tokens)
        s = buckets.seq_bucket_for(t, self.scheduler_config.max_num_seqs)
        longest = max(seq.start_pos + len(seq.token_ids) for seq in sched.seqs)
        b = buckets.pick(self.width_buckets, math.ceil(longest / self.block_size))
        decode_only = (self.decode_variants or t == 1) and sched.num_batched_tokens == len(sched.seqs)
        return t, s, b, decode_only

    @property
    def num_step_shapes(self) -> int:
        """Every step program this runner may use (compiled at start-up or on first use)."""
        return len(self._all_shapes())

    def _all_shapes(self) -> list[tuple[int, int, bool]]:
        return self._with_decode_variants([(t, b) for t in self.token_buckets for b in self.width_buckets])

    def _with_decode_variants(self, shapes: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """(T, B) -> (T, B, False), plus (T, B, True) for token buckets a pure-decode step can land in; a
        1-token bucket has the decode program only."""
        out = [(t, b, t == 1) for t, b in shapes]
        if self.decode_variants:
            most = buckets.pick(self.token_buckets, min(self.scheduler_config.max_num_seqs, self.token_buckets[-1]))
            out += [(t, b, True) for t, b in shapes if 1 < t <= most]
        return out

    def step_params(self) -> list[jax.Array]:
        """The step's flat parameter list: the model's, then the LoRA slots' (whose arrays change on loads)."""
        return self.params if self.lora is None else self.params + self.lora.arrays

    @staticmethod
    def _metadata(x: StepInputs) -> AttentionMetadata:
        return AttentionMetadata(
            positions=x.positions,
            slot_mapping=x.slot_mapping,
            token_seq_ids=x.token_seq_ids,
            query_start_loc=x.query_start_loc,
            seq_lens=x.seq_lens,
            block_tables=x.block_tables,
            logits_indices=x.logits_indices,
        )

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and wait for it; rows of the result follow ``sched.seqs``."""
        return self.fetch(self.dispatch(sched))

    @property
    def defers_masks(self) -> bool:
        """Whether ``dispatch`` can launch the model before a grammar's mask is known (the compiled path, whose
        sampler is a program of its own)."""
        return self._eager_model is None

    def dispatch(self, sched: SchedulerOutput, defer_masks: bool = False) -> StepHandle:
        """Launch one scheduled step without waiting for it. Placeholder tokens (``seq.num_placeholders``)
        are taken on the device from the samples of the step dispatched just before this one.

        ``defer_masks`` (structured outputs, with ``defers_masks``): launch the model only; the sampler waits for
        ``sample_deferred``, which fills the grammar rows' masks once their grammars have taken the tokens of the
        step before (read back while this one's model runs)."""
        t, s, b, decode_only = self._shapes_for(sched)
        if (t, b, decode_only) not in self.compiled_shapes and self._eager_model is None:
            # Not compiled at start-up (precompile): jit compiles it inside this call, once.
            logger.info("compiling step shape tokens=%d ctx=%d%s on first use", t, b * self.block_size,
                        " (decode only)" if decode_only else "")
            self.compiled_shapes.add((t, b, decode_only))
            self.num_lazy_compiles += 1
        x = build_step_inputs(
            sched.seqs,
            num_tokens_padded=t,
            num_seqs_padded=s,
            block_width=b,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            lora_slots=self.lora.prepare([seq.lora_request for seq in sched.seqs]) if self.lora is not None else None,
        )
        sampling_md = SamplingMetadata.from_seqs(sched.seqs, s, self._history_len(sched), fill_masks=not defer_masks)
        mm_fields = None
        if self.vision is not None:  # encodes (dispatches) any image this step reads that is not cached
            mm_fields = self.vision.step_fields(sched.seqs, x.positions, x.query_start_loc)
        if self._calibration_pending:
            self._calibrate_kv_scales(sched, x)
        targets = prompt_logprobs.targets_for(sched.seqs, t)
        out, plp = self._run(x, sampling_md, decode_only, mm_fields, targets, defer_masks)
        self.num_steps += 1
        if defer_masks:  # ``out`` launches the sampler
            return StepHandle(None, len(sched.seqs), plp, deferred=(out, sched.seqs, sampling_md))
        self._last_tokens = out.token_ids
        return StepHandle(out, len(sched.seqs), plp)

    def sample_deferred(self, handle: StepHandle) -> None:
        """Fill the grammar rows' masks of a step dispatched with ``defer_masks`` and launch its sampler (before
        the next dispatch, which takes its placeholders from these samples)."""
        launch, seqs, md = handle.deferred
        fill_token_masks(md.token_mask, seqs, [i for i, seq in enumerate(seqs) if seq.sample and seq.grammar is not None])
        handle.sampled, handle.deferred = launch(), None
        self._last_tokens = handle.sampled.token_ids

    def _calibrate_kv_scales(self, sched: SchedulerOutput, x: StepInputs) -> None:
        """calculate_kv_scales: set every layer's fp8 scales from this (the first) step's K/V, before it runs."""
        if any(seq.start_pos or seq.num_placeholders for seq in sched.seqs):
            raise RuntimeError("calculate_kv_scales: the first step must hold only prompts starting at position 0")
        amax = kv_scale_calibration.calibrate(self.graphdef, self._treedef, self.params, x.input_ids, self._metadata(x))
        self.kv_scales = kv_scale_calibration.scales_from_amax(amax, self.kv_dtype)
        logger.info("calculate_kv_scales: per-layer (k_scale, v_scale) from the first prefill: %s",
                    [(round(k, 6), round(v, 6)) for k, v in self.kv_scales])
        self._kv_scales_arr = jax.device_put(np.asarray(self.kv_scales, np.float32), self._last_tokens.sharding)
        if self._eager_model is not None:
            kv_scale_calibration.with_kv_scales(self._eager_model, np.asarray(self.kv_scales, np.float32))
        self._calibration_pending = False

    @staticmethod
    def ready(handle: StepHandle) -> bool:
        """Whether a dispatched step's samples have been computed (never blocks)."""
        return handle.sampled.token_ids.is_ready()

    @staticmethod
    def fetch(handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a dispatched step and copy its samples to the host (one transfer; two with prompt logprobs)."""
        out = to_runner_output(handle.sampled, handle.num_rows)
        if handle.prompt_logprobs is not None:
            out.prompt_logprobs = jax.tree.map(np.asarray, jax.device_get(handle.prompt_logprobs))
        return out

    def _history_len(self, sched: SchedulerOutput) -> int:
        distinct = {id(seq.sampling_params): seq.sampling_params for seq in sched.seqs}.values()  # often one
        if not any(sp.uses_penalties for sp in distinct):
            return 0
        longest = max(len(seq.history) for seq in sched.seqs)
        return min(1 << max(4, (longest - 1).bit_length()), self.model_config.max_model_len)

    def _mm_args(self, mm_fields: np.ndarray | None) -> tuple:
        return () if self.vision is None else (mm_fields, self.vision.pool)

    def _run(
        self, x: StepInputs, sampling_md: SamplingMetadata, decode_only: bool = False, mm_fields=None, targets=None,
        defer_sampling: bool = False,
    ) -> tuple[Any, Any]:
        """-> (the samples, PromptLogprobs or None); ``targets`` [T] (prompt_logprobs.targets_for) or None.
        ``defer_sampling`` (compiled path): the model only, and instead of the samples a function that launches
        the sampler."""
        plp = None
        if self._eager_model is not None:
            md = self._metadata(x)
            prev = jnp.asarray(x.prev_index)
            input_ids = jnp.where(prev >= 0, self._last_tokens[jnp.maximum(prev, 0)], jnp.asarray(x.input_ids))
            mm = mm_kwargs(tuple(jnp.asarray(a) for a in self._mm_args(mm_fields)))
            hidden, self.kv_caches = run_model(self._eager_model, input_ids, self.kv_caches, md, self.aux_layers, **mm)
            logits = self._eager_model.compute_logits(hidden[md.logits_indices])
            if targets is not None:
                plp = prompt_logprobs.prompt_logprobs_of(self._eager_model, hidden, jnp.asarray(targets))
            return sample_padded(logits, sampling_md, self.max_rows), plp
        key = (x.input_ids.shape[0], x.block_tables.shape[1], decode_only)
        args = (self.step_params(), self.kv_caches, *pack_inputs(x), self._last_tokens, self._kv_scales_arr,
                *self._mm_args(mm_fields))  # fmt: skip
        if targets is None:
            logits, greedy, self.kv_caches = self._program(key, args)(*args)
        else:
            args = (*args[:6], targets, *args[6:])
            logits, greedy, self.kv_caches, plp = self._plp_program(key, args)(*args)
        if sampling_md.plain_greedy:
            return SamplerOutput(token_ids=greedy), plp  # the step's own argmax: no sampler program to launch
        sampler = functools.partial(self._sampler_programs.get(_sampler_key(sampling_md), self._sample), logits,
                                    sampling_md)
        return (sampler if defer_sampling else sampler()), plp

    # ------------------------------------------------------------------ compile

    def warmup(self, progress: bool = True) -> float:
        """Compile the start-up step shapes (``runner_config.precompile``) and their sampler variants; returns
        seconds. Other shapes compile on first use (``dispatch`` logs each).

        Ahead-of-time: a step program stored by an earlier start (accelerators: jaxserve.executable_store)
        is loaded without tracing; any other is traced and lowered here (Python, under the GIL), then
        compiled in a thread pool, since XLA compiles without the GIL: the shapes compile side by side on
        the host's cores. The steps then call those compiled programs directly; the sampler's land in jit's
        in-memory cache. Nothing runs on CPU, where a dummy step of a large bucket costs real seconds; on
        accelerators every step program runs once (``_prime``).
        """
        if self._eager_model is not None:
            return 0.0
        start = time.perf_counter()
        shapes = self._with_decode_variants(
            buckets.startup_shapes(self.token_buckets, self.width_buckets, self.runner_config.precompile)
        )
        store = self._executable_store()
        workers = max(1, min(len(shapes), os.cpu_count() or 1, 8))
        bar = tqdm(total=len(shapes), desc="Compiling step shapes", unit="shape", disable=not progress, leave=False)

        def compile_step(shape: tuple[int, int, bool], lowered) -> None:
            t0 = time.perf_counter()
            extra = self._shape_options(shape[0])  # beyond the jit's compiler_options (gemm_backend)
            self._programs[shape] = program = lowered.compile(extra)
            self.compile_seconds[shape] = time.perf_counter() - t0  # side by side with others: wall, not CPU
            if store is not None:
                store.save(_step_name(shape, self._step_options, extra), program)

        def compile_sampler(key: tuple, lowered) -> None:
            self._sampler_programs[key] = program = lowered.compile()
            if store is not None:
                store.save(_sampler_name(key), program)

        loaded_steps = 0
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool:
            jobs = []
            for key, lower in self._sampler_variants(shapes):
                program = store.load(_sampler_name(key), list(self.mesh.devices.flat)) if store is not None else None
                if program is not None:
                    self._sampler_programs[key] = program
                else:
                    jobs.append(pool.submit(compile_sampler, key, lower()))
            for shape in shapes:
                name = _step_name(shape, self._step_options, self._shape_options(shape[0]))
                program = store.load(name, list(self.mesh.devices.flat)) if store is not None else None
                if program is not None:
                    self._programs[shape] = program
                    loaded_steps += 1
                    bar.update()
                    continue
                lowered = self._steps[shape[2]].lower(*self._dummy_args(*shape[:2]))
                jobs.append(pool.submit(compile_step, shape, lowered))
                jobs[-1].add_done_callback(lambda _: bar.update())
            for job in concurrent.futures.as_completed(jobs):
                job.result()  # a failed compile raises here, at start-up
        bar.close()
        if self.compile_seconds:
            slowest = sorted(self.compile_seconds.items(), key=lambda kv: -kv[1])[:3]
            logger.info("slowest step compiles: %s", ", ".join(
                f"tokens={t} ctx={b * self.block_size}{' decode' if d else ''} {sec:.1f}s" for (t, b, d), sec in slowest))
        self.compiled_shapes.update(shapes)
        self.num_loaded_programs = loaded_steps  # step programs only: store.hits counts the samplers' too
        if store is not None:
            logger.info("step programs: %d loaded from %s, %d compiled", store.hits, store.root, store.misses)
        if shapes and self.runner_config.platform != "cpu":
            self._prime(shapes)
        return time.perf_counter() - start

    def _prime(self, shapes: list[tuple[int, int, bool]]) -> None:
        """Run every start-up step program once on padding (accelerators; on CPU a large dummy step costs
        real seconds). The largest goes first, so a memory shortfall shows at start-up. Every program's first
        launch also loads its kernels and builds its command buffer (a CUDA graph), which costs the host
        milliseconds. Unprimed, that lands on the first real step of each shape. On a server that is a
        request's first token. Offline it is the tail, where the batch shrinks through the smaller decode
        buckets one after another, so every step there waits on the host (BENCHMARKS §29)."""
        logits = None
        for t, b, decode_only in sorted(shapes, reverse=True):
            logits, _, self.kv_caches = self._programs[(t, b, decode_only)](*self._dummy_args(t, b))
        jax.block_until_ready(logits)

    def _executable_store(self, extra: dict | None = None) -> ExecutableStore | None:
        """Where step programs persist between starts, keyed by everything (besides the code and JAX) that
        shapes them. ``extra``: what else shapes another user's programs over these weights and cache (an
        EAGLE head's rounds): a store of its own context."""
        context = {
            "model": repr(self.text_config),
            "model_config": repr(self.model_config),
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "kv_dtype": self.kv_dtype.name,  # a bf16-cache program must never run over an fp8 cache
            "kv_scales": "traced" if self.calculate_kv_scales else self.kv_scales,  # traced: any values, one program
            "max_rows": self.max_rows,
            "max_num_seqs": self.scheduler_config.max_num_seqs,
            "image_pool_rows": self._pool_rows,  # a vision-language step's pool argument has this many rows
            "runner": repr(self.runner_config),
            # Not the device ids: a data-parallel replica on other devices of the same kind loads the same
            # programs onto its own devices.
            "mesh": repr(dict(self.mesh.shape)),
            "params": [(x.shape, str(x.dtype), repr(getattr(x.sharding, "spec", x.sharding))) for x in self.params],
            "tree": str(self._treedef),
        }
        if self.lora_config is not None:  # only then, so that stores written without LoRA stay valid
            context["lora"] = repr(self.lora_config)  # the slot arrays' shapes follow from it; the token fields have 6 rows
        if self.v_token_minor:  # the cache's V pages are [N, K, D, P] (absent: keys stay as before)
            context["v_token_minor"] = True
        if self.kv_heads_major:  # the cache's pages are [N, K, P, D]: a program stored before reads [N, P, K, D]
            context["kv_heads_major"] = True
        if self.aux_layers:  # EAGLE: the steps also write the hidden-state store (absent: keys stay as before)
            context["aux_layers"] = self.aux_layers
        if extra:
            context["extra"] = extra
        return ExecutableStore.open(self.runner_config.compilation_cache_dir, self.runner_config.platform, context)

    def _sampler_variants(self, shapes: list[tuple[int, int]]) -> list[tuple[tuple, Any]]:
        """(key, lower) for the sampler's programs at every row count S the start-up shapes reach (S depends on
        T only); the logprobs variants only with precompile="all" (others compile on first use, through jit)."""
        with_logprobs = self.runner_config.precompile == "all"
        rows = sorted({buckets.seq_bucket_for(t, self.scheduler_config.max_num_seqs) for t, *_ in shapes})
        out = []
        for s in rows:
            # The sharding the step's logits really have: with another, the first real call would miss this program.
            logits = jax.ShapeDtypeStruct((s, self.text_config.vocab_size), jnp.float32, sharding=self._logits_sharding)
            for md in SamplingMetadata.warmup_variants(s, with_logprobs):
                if md.plain_greedy:
                    continue  # the step's own argmax serves it (_run)
                out.append((_sampler_key(md), functools.partial(self._sample.lower, logits, md)))
        return out

    def _shape_options(self, t: int) -> dict | None:
        """XLA options of one step shape beyond the jit's own (gemm_backend: large steps use cuBLAS)."""
        return gemm_backend.compiler_options(self.runner_config.platform, t)

    def _program(self, key: tuple[int, int, bool], args: tuple):
        """The compiled step for ``key``: from start-up, or compiled now (first use) with the shape's options."""
        program = self._programs.get(key)
        if program is not None:
            return program
        extra = self._shape_options(key[0])
        if extra is None:
            return self._steps[key[2]]  # jit compiles it inside the call, once
        program = self._programs[key] = self._steps[key[2]].lower(*args).compile(extra)
        return program

    def _plp_program(self, key: tuple[int, int, bool], args: tuple):
        """The prompt-logprobs step for ``key``, compiled on its first use with the shape's options, as ``_program``
        compiles a step not compiled at start-up."""
        program = self._plp_programs.get(key)
        if program is None:
            logger.info("compiling step shape tokens=%d ctx=%d with prompt logprobs on first use", key[0],
                        key[1] * self.block_size)
            jitted, extra = self._plp_steps[key[2]], self._shape_options(key[0])
            program = self._plp_programs[key] = jitted if extra is None else jitted.lower(*args).compile(extra)
        return program

    def _dummy_args(self, t: int, b: int) -> tuple:
        """The step's arguments for a padding-only batch of shape (t tokens, b blocks per sequence)."""
        s = buckets.seq_bucket_for(t, self.scheduler_config.max_num_seqs)
        x = dummy_inputs(t, s, b, self.num_blocks * self.block_size)
        if self.lora is not None:
            x.lora_slots = np.zeros(t, np.int32)
        mm = self._mm_args(self.vision.dummy_fields(t)) if self.vision is not None else ()
        return self.step_params(), self.kv_caches, *pack_inputs(x), self._last_tokens, self._kv_scales_arr, *mm


def _sampler_key(md: SamplingMetadata) -> tuple:
    """What selects one compiled sampler: the row count, the static flags, the history width, and with a logit_bias
    or a grammar's mask the widths of those arrays (one program per pair)."""
    key = (md.num_rows, md.all_greedy, md.needs_penalties, md.needs_filters, md.needs_logprobs, md.needs_bans,
           md.history.shape[1])
    widths = (md.bias_ids.shape[1] if md.needs_bias else 0, md.token_mask.shape[1] if md.needs_mask else 0)
    return key + widths if any(widths) else key


def _step_name(shape: tuple[int, int, bool], options: dict | None, shape_options: dict | None = None) -> str:
    t, b, decode_only = shape
    tail = launch_mode.describe(options) + gemm_backend.describe(shape_options)
    return f"step-t{t}-b{b}" + ("-decode" if decode_only else "") + tail


def _sampler_name(key: tuple) -> str:
    return "sample-" + "-".join(str(int(v)) for v in key)
