"""Rooflines for the benches: the fastest a workload could run on this machine, from rates measured in the same job.

Two rates are measured (before the engine is built, so that its KV cache has not taken the memory yet):
- copy rate: bytes read + written per second by a large elementwise copy (jax on an accelerator; numpy on
  the CPU, where XLA's copy is not the fastest the host can do). The issue's "4.3 TB/s" is this quantity.
- matmul rate: FLOP/s of a large square matmul in the model's dtype (bf16 on GPU, fp32 on CPU).

Weight bytes and FLOPs come from the model's config (every parameter counted, embeddings included, as the
issue's weight-read roofline counts them), so no engine internals are needed.
"""

from __future__ import annotations

import math
import statistics
import time

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _median_seconds(fn, sync, rounds: int) -> float:
    sync(fn())  # warm up (and compile)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy_rate(quick: bool = False) -> float:
    """Bytes moved (read + written) per second by one large copy on the default device."""
    import jax

    if jax.devices()[0].platform == "cpu":
        import numpy as np

        src = np.ones((1 << (22 if quick else 26),), np.float32)  # 16 MiB / 256 MiB: far past the caches
        dst = np.empty_like(src)
        seconds = _median_seconds(lambda: np.copyto(dst, src), lambda _: None, rounds=3 if quick else 7)
        return 2 * src.nbytes / seconds
    import jax.numpy as jnp

    # 4 GiB of 32-bit words, updated in place (donated): each call reads and writes every byte once, with
    # no allocation in the timed loop. (A bf16 `a + 1` into a fresh buffer measured 2.8 TB/s on an H200.)
    state = {"x": jnp.ones((1 << (20 if quick else 30),), jnp.uint32)}
    nbytes = state["x"].nbytes
    add = jax.jit(lambda a: a + 1, donate_argnums=0)  # a bare copy may be elided; an add cannot

    def step():
        state["x"] = add(state["x"])
        return state["x"]

    seconds = _median_seconds(step, jax.block_until_ready, rounds=3 if quick else 10)
    del state
    return 2 * nbytes / seconds


def measure_matmul_rate(dtype: str, quick: bool = False) -> float:
    """FLOP/s of an m x m x m matmul in ``dtype`` on the default device."""
    import jax
    import jax.numpy as jnp

    on_cpu = jax.devices()[0].platform == "cpu"
    m = 256 if quick else (1024 if on_cpu else 8192)
    a = jax.random.normal(jax.random.key(1), (m, m), dtype)
    b = jax.random.normal(jax.random.key(2), (m, m), dtype)
    seconds = _median_seconds(lambda: jnp.dot(a, b), jax.block_until_ready, rounds=3 if quick else 10)
    return 2 * m**3 / seconds


def measure_rates(dtype: str, quick: bool = False, matmul: bool = True) -> dict:
    rates = {"copy_bytes_per_s": measure_copy_rate(quick)}
    if matmul:
        rates["matmul_flops_per_s"] = measure_matmul_rate(dtype, quick)
        rates["matmul_dtype"] = dtype
    return rates


# ---------------------------------------------------------------- the model's sizes


def param_counts(cfg) -> dict:
    """Parameters of a Llama-family text model (TextModelConfig): per layer (matmuls only) and in all."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer_matmul = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    layer_other = 2 * h  # the two RMSNorms
    if cfg.attention_bias:
        layer_other += q + 2 * kv
    if cfg.o_proj_bias:
        layer_other += h
    if cfg.mlp_bias:
        layer_other += 2 * cfg.intermediate_size + h
    if cfg.qk_norm:
        layer_other += 2 * cfg.head_dim
    embed = cfg.vocab_size * h
    lm_head = 0 if cfg.tie_word_embeddings else embed
    total = cfg.num_hidden_layers * (layer_matmul + layer_other) + embed + lm_head + h
    return {"layer_matmul": layer_matmul, "lm_head": embed, "total": total}


def weight_bytes(cfg, dtype: str) -> int:
    return param_counts(cfg)["total"] * _DTYPE_BYTES[dtype]


def _kv_bytes_per_position(cfg, dtype: str) -> int:
    """K and V of one token in every layer."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * _DTYPE_BYTES[dtype]


# ---------------------------------------------------------------- rooflines


def single_stream(cfg, dtype: str, copy_rate: float, held_bytes: int | None = None) -> dict:
    """One sequence decoding: every token must read every weight once (the KV cache of a few hundred tokens
    is under 1% of that for 8B and is left out, as in the issue's definition). ``held_bytes``: the bytes the
    engine's weights really take, where they differ from the config's count in ``dtype`` (GGUF weights kept
    quantized, models/quantized.py; fp8 weights, models/fp8_weights.py)."""
    wb = held_bytes or weight_bytes(cfg, dtype)
    return {"weight_bytes": wb, "copy_bytes_per_s": copy_rate, "tokens_per_s": copy_rate / wb}


def offline(cfg, dtype: str, work: list, max_num_seqs: int, max_num_batched_tokens: int, rates: dict) -> dict:
    """A lower bound on the time of an offline run of ``work`` (BenchRequests, EOS ignored), and the output
    tokens/s it allows: max(FLOPs / matmul rate, bytes / copy rate).

    FLOPs: 2 per matmul weight per computed position (prompt + output - 1 per request), the LM head only at
    sampled positions, and causal attention's 4 * heads * head_dim per visible query-key pair.
    Bytes: every engine step reads all weights once, at the fewest steps possible (each request needs one
    step per output token; a step holds at most max_num_seqs sequences and max_num_batched_tokens tokens),
    plus every decode token's read of its KV context and every position's KV write.

    A second, tighter bound (``serial_*``): one device stream runs a step's kernels one after another, so
    attention's KV traffic cannot hide under the matmuls, which are compute-bound at hundreds of tokens a step.
    It adds them: max(FLOPs / matmul rate, weight bytes / copy rate) + KV bytes / copy rate.
    """
    pc = param_counts(cfg)
    positions = sum(len(w.prompt_token_ids) + w.output_len - 1 for w in work)
    sampled = sum(w.output_len for w in work)
    # Sum over requests of sum_{p < n} (p + 1) visible keys = n (n + 1) / 2, n = the request's positions.
    pairs = sum((n := len(w.prompt_token_ids) + w.output_len - 1) * (n + 1) // 2 for w in work)
    attn_flops = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers * pairs
    flops = 2 * pc["layer_matmul"] * cfg.num_hidden_layers * positions + 2 * pc["lm_head"] * sampled + attn_flops

    decode_tokens = sum(w.output_len - 1 for w in work)
    steps = max(
        max(w.output_len for w in work),
        math.ceil(positions / max_num_batched_tokens),
        math.ceil(decode_tokens / max_num_seqs),
    )
    kv = _kv_bytes_per_position(cfg, dtype)
    # A decode token at position p reads p + 1 positions of K and V; sum over p in [len_in, len_in + out - 1).
    decode_reads = sum(sum(range(len(w.prompt_token_ids) + 1, len(w.prompt_token_ids) + w.output_len)) for w in work)
    weights_moved, kv_moved = steps * weight_bytes(cfg, dtype), kv * (decode_reads + positions)
    bytes_moved = weights_moved + kv_moved

    flops_s = flops / rates["matmul_flops_per_s"]
    bytes_s = bytes_moved / rates["copy_bytes_per_s"]
    bound_s = max(flops_s, bytes_s)
    kv_s = kv_moved / rates["copy_bytes_per_s"]
    serial_s = max(flops_s, weights_moved / rates["copy_bytes_per_s"]) + kv_s
    return {
        "flops": flops, "attention_flops": attn_flops, "bytes": bytes_moved, "kv_bytes": kv_moved, "min_steps": steps,
        "flops_s": flops_s, "bytes_s": bytes_s, "bound": "compute" if flops_s >= bytes_s else "memory",
        "seconds": bound_s, "output_tokens_per_s": sampled / bound_s, "kv_s": kv_s, "serial_seconds": serial_s,
        "serial_output_tokens_per_s": sampled / serial_s, **rates,
    }


def format_rates(rates: dict) -> str:
    text = f"copy {rates['copy_bytes_per_s'] / 1e9:.1f} GB/s"
    if "matmul_flops_per_s" in rates:
        text += f", {rates['matmul_dtype']} matmul {rates['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s"
    return text
