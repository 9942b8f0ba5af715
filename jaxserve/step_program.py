"""The step as a pure function, and the packed form its inputs travel in.

``forward_step`` is what the runner jits once per static shape: (weights, KV cache, packed batch) -> (logits of
each sequence's last token, their argmax, the updated cache). ``pack_inputs`` turns the host's StepInputs into
the two int32 arrays the step takes, and ``unpack_inputs`` rebuilds them inside the trace. The speculative
verify step and the draft/EAGLE programs build on the same pieces (jaxserve.spec_decode).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import kv_scale_calibration
from jaxserve.batch_builder import StepInputs
from jaxserve.models.lora import for_layers as lora_for_layers
from jaxserve.pallas_kernels import cpu_native
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.sampler import SamplerOutput, argmax, sample
from jaxserve.sampling_metadata import SamplingMetadata


def forward_step(
    graphdef, treedef, num_rows_max, decode_only, lora_spec, aux_layers, params, kv_caches, tok_fields, seq_fields,
    prev_tokens, kv_scales, *mm, native_products: bool = False,
):
    """Pure step: (params, cache, packed batch) -> (logits of each sequence's last token [S, V], their argmax
    padded to [S_max], new cache).

    The batch travels as two int32 arrays (``pack_inputs``): one host-to-device copy each, where one per field
    cost the host ~60 us apiece. Where a token's ``prev_index`` is >= 0 it is the previous step's sample
    ``prev_tokens[prev_index]`` ([S_max] i32, still on the device). The argmax is the whole sampler of a plain
    greedy batch, which then needs no second program (``_run``). ``decode_only`` (static) marks the variant
    compiled for steps whose every sequence has one new token (see AttentionMetadata.decode_only).
    ``lora_spec`` (static): None, or (number of model parameters, layers) when ``params`` ends with the LoRA
    slot arrays (jaxserve.lora.slots) and ``tok_fields`` has the tokens' slot row.
    ``aux_layers`` (static; EAGLE only, else ()): see ``run_model``.
    ``kv_scales`` [L, 2] f32 (calculate_kv_scales only; else None): the layers' fp8 scales as traced values.
    A vision-language model's step also takes ``mm = (mm_fields [4, T] i32, image pool [P, D])``
    (jaxserve.vision_runner); a text model's program has no such arguments.
    ``native_products`` (static): one-row float32 products may take the CPU's native kernel (cpu_native.products;
    only for a program on one device).
    """
    model, hidden, md, kv_caches = _model_over_step(
        graphdef, treedef, decode_only, lora_spec, aux_layers, params, kv_caches, tok_fields, seq_fields, prev_tokens,
        kv_scales, mm, native_products,
    )
    return *_last_token_logits(model, hidden, md, num_rows_max, native_products), kv_caches


def forward_step_with_prompt_logprobs(
    graphdef, treedef, num_rows_max, decode_only, lora_spec, aux_layers, params, kv_caches, tok_fields, seq_fields,
    prev_tokens, kv_scales, targets, *mm, native_products: bool = False,
):
    """``forward_step`` plus each token's prompt logprobs (jaxserve.prompt_logprobs): ``targets`` [T] i32 is the
    prompt token that follows each token (-1 where none is wanted). -> (logits, greedy, cache, PromptLogprobs)."""
    from jaxserve.prompt_logprobs import prompt_logprobs_of

    model, hidden, md, kv_caches = _model_over_step(
        graphdef, treedef, decode_only, lora_spec, aux_layers, params, kv_caches, tok_fields, seq_fields, prev_tokens,
        kv_scales, mm, native_products,
    )
    logits, greedy = _last_token_logits(model, hidden, md, num_rows_max, native_products)  # as forward_step's
    return logits, greedy, kv_caches, prompt_logprobs_of(model, hidden, targets)


def _last_token_logits(model, hidden, md: AttentionMetadata, num_rows_max: int, native_products: bool):
    """(logits of each sequence's last token [S, V] f32, their argmax padded to [S_max])."""
    with cpu_native.products(native_products):
        logits = model.compute_logits(hidden[md.logits_indices])  # [S, V] f32
    return logits, jnp.pad(argmax(logits), (0, num_rows_max - logits.shape[0]))


def _model_over_step(
    graphdef, treedef, decode_only, lora_spec, aux_layers, params, kv_caches, tok_fields, seq_fields, prev_tokens,
    kv_scales, mm, native_products,
):
    """The step's model pass: (the merged model, final hidden states [T, E], AttentionMetadata, new caches)."""
    input_ids, prev_index, md = unpack_inputs(tok_fields, seq_fields, decode_only)
    input_ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], input_ids)
    lora = None
    if lora_spec is not None:
        num_model_params, num_layers = lora_spec
        lora = lora_for_layers(params[num_model_params:], tok_fields[5], num_layers)
        params = params[:num_model_params]
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    if kv_scales is not None:
        kv_scale_calibration.with_kv_scales(model, kv_scales)
    lora_kw = {"lora": lora} if lora is not None else {}
    with cpu_native.products(native_products):
        hidden, kv_caches = run_model(model, input_ids, kv_caches, md, aux_layers, **lora_kw, **mm_kwargs(mm))  # [T, E]
    return model, hidden, md, kv_caches


def mm_kwargs(mm: tuple) -> dict:
    """The vision-language model's extra step inputs as its keyword arguments (none for a text model)."""
    if not mm:
        return {}
    fields, pool = mm  # [4, T] i32 (3 M-RoPE rows, embed_index), [P, D]
    return dict(mrope_positions=fields[:3], image_embeds=pool, embed_index=fields[3])


def run_model(
    model, input_ids, kv_caches: list, md: AttentionMetadata, aux_layers: tuple[int, ...] = (), with_aux=False, **kw
):
    """The model over the step (``kw``: LoRA or image inputs). With ``aux_layers`` (EAGLE speculation),
    ``kv_caches`` ends with one more array, the hidden-state store [num_slots, W], and the hidden states the
    EAGLE head reads are written to it at each token's KV slot, beside its KV: the head later gathers them per
    position through the same block tables (jaxserve.spec_decode.eagle). -> (final hidden [T, E], caches), and
    with ``with_aux`` those hidden states too ([T, W] in the store's dtype)."""
    if not aux_layers:
        return model(input_ids, kv_caches, md, **kw)
    hidden, layer_caches, aux = model(input_ids, kv_caches[:-1], md, aux_layers=aux_layers, **kw)  # aux [T, W]
    aux = aux.astype(kv_caches[-1].dtype)
    store = kv_caches[-1].at[md.slot_mapping].set(aux, mode="drop")
    return (hidden, [*layer_caches, store], aux) if with_aux else (hidden, [*layer_caches, store])


def compile_in_parallel(lowered: dict, options: dict | None = None) -> dict:
    """{key: jax Lowered} -> {key: compiled program}, compiled side by side (XLA compiles without the GIL), with
    XLA ``options`` (jaxserve.launch_mode) or its defaults."""
    workers = max(1, min(len(lowered), os.cpu_count() or 1, 8))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool:
        jobs = {key: pool.submit(low.compile, options) for key, low in lowered.items()}
        return {key: job.result() for key, job in jobs.items()}


def load_or_compile(store, devices: list, shapes, name_of, lower, options: dict | None = None) -> tuple[dict, int]:
    """Programs for ``shapes``: each loaded from the executable ``store`` under ``name_of(shape)`` when an earlier
    start saved it there, else lowered by ``lower(shape)``, compiled side by side and saved. ``store`` None (CPU):
    everything compiles; ``options``: XLA's, for every program (``name_of`` must tell them apart). Returns
    ({shape: program}, how many were loaded)."""
    programs, lowered = {}, {}
    for shape in shapes:
        program = store.load(name_of(shape), devices) if store is not None else None
        if program is not None:
            programs[shape] = program
        else:
            lowered[shape] = lower(shape)
    compiled = compile_in_parallel(lowered, options)
    if store is not None:
        for shape, program in compiled.items():
            store.save(name_of(shape), program)
    return {**programs, **compiled}, len(programs)


def pack_inputs(x: StepInputs) -> tuple[np.ndarray, np.ndarray]:
    """StepInputs -> (tok_fields [5, T] (or [6, T] with LoRA slots), seq_fields [S, 3 + B]), int32.
    query_start_loc[0] is always 0 and is left out, so that the per-sequence fields share one row each."""
    rows = [x.input_ids, x.prev_index, x.positions, x.slot_mapping, x.token_seq_ids]
    if x.lora_slots is not None:
        rows.append(x.lora_slots)
    tok = np.stack(rows)  # [5 or 6, T]
    seq = np.concatenate(
        [x.query_start_loc[1:, None], x.seq_lens[:, None], x.logits_indices[:, None], x.block_tables], axis=1
    )  # [S, 3 + B]
    return tok, seq


def unpack_inputs(
    tok: jax.Array, seq: jax.Array, decode_only: bool = False, decode_query_len: int = 1
) -> tuple[jax.Array, jax.Array, AttentionMetadata]:
    """The inverse of pack_inputs, inside the step: (input_ids [T], prev_index [T], AttentionMetadata).
    ``decode_only`` / ``decode_query_len``: the program's static promise about its steps (AttentionMetadata)."""
    md = AttentionMetadata(
        positions=tok[2],
        slot_mapping=tok[3],
        token_seq_ids=tok[4],
        query_start_loc=jnp.concatenate([jnp.zeros(1, jnp.int32), seq[:, 0]]),
        seq_lens=seq[:, 1],
        block_tables=seq[:, 3:],
        logits_indices=seq[:, 2],
        decode_only=decode_only,
        decode_query_len=decode_query_len,
    )
    return tok[0], tok[1], md


def sample_padded(logits: jax.Array, md: SamplingMetadata, num_rows_max: int) -> SamplerOutput:
    """The sampler, with token ids padded to ``num_rows_max`` rows so the next step takes one shape."""
    out = sample(logits, md)
    token_ids = jnp.pad(out.token_ids, (0, num_rows_max - out.token_ids.shape[0]))  # [S_max]
    return dataclasses.replace(out, token_ids=token_ids)


def dummy_inputs(t: int, s: int, b: int, dropped_slot: int) -> StepInputs:
    """A batch of padding only: every KV write lands out of range and is dropped."""
    zeros_t = np.zeros(t, np.int32)
    return StepInputs(
        input_ids=zeros_t,
        prev_index=np.full(t, -1, np.int32),
        positions=zeros_t,
        slot_mapping=np.full(t, dropped_slot, np.int32),
        token_seq_ids=zeros_t,
        query_start_loc=np.zeros(s + 1, np.int32),
        seq_lens=np.zeros(s, np.int32),
        block_tables=np.zeros((s, b), np.int32),
        logits_indices=np.zeros(s, np.int32),
    )
