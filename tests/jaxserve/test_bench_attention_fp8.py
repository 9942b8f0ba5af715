"""The fp8 attention bench's variant options: what each row runs, parsed without running a kernel."""

from __future__ import annotations

import pytest

from jaxserve.bench import attention_fp8 as bench


def test_variant_parsing_and_rows_cover_every_format_and_compute():
    name, over = bench._parse_variant("tail=decode_mask_tail_only=true,decode_tile_tokens=32")
    assert (name, over) == ("tail", {"decode_mask_tail_only": True, "decode_tile_tokens": 32})
    variants = [(name, over)]
    bf16 = list(bench._configs("auto", ["float16", "query"], variants))
    assert [(v, c) for v, c, *_ in bf16] == [("default", "-"), ("tail", "-")]  # fp8 modes mean nothing for bf16
    fp8_rows = list(bench._configs("fp8_e4m3", ["float16", "query"], variants))
    assert [(v, c) for v, c, *_ in fp8_rows] == [
        ("default", "float16"), ("default", "query"), ("tail", "float16"), ("tail", "query"),
    ]  # fmt: skip
    cfg = fp8_rows[-1][2]
    assert cfg.fp8_decode_compute == "query" and cfg.decode_mask_tail_only and cfg.decode_tile_tokens == 32
    assert not any(v_minor for *_, v_minor in fp8_rows)


def test_token_minor_v_variant_applies_to_fp8_rows_only():
    variants = [bench._parse_variant("tm=fp8_v_token_minor=true")]
    assert variants == [("tm", {"fp8_v_token_minor": True})]
    assert [m for *_, m in bench._configs("auto", ["float16"], variants)] == [False, False]
    assert [m for *_, m in bench._configs("fp8_e5m2", ["float16"], variants)] == [False, True]


def test_unknown_field_or_compute_names_the_choices():
    with pytest.raises(SystemExit, match="GpuKernelConfig field"):
        bench._parse_variant("x=decode_tiles=32")
    with pytest.raises(SystemExit, match="query"):
        bench.main(["--fp8-decode-compute", "float8", "--quick"])


@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3"])
def test_whole_prompt_reference_matches_the_paged_reference(fmt):
    """The prefill rows' reference (one sequence at a time, to fit the GPU) is the engine's reference backend."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxserve.pallas_kernels import fp8
    from jaxserve.pallas_kernels.attention import paged_attention
    from jaxserve.pallas_kernels.random_batch import make_batch

    batch = make_batch(np.random.default_rng(0), q_lens=[24, 24], ctx_lens=[24, 24], num_heads=4, num_kv_heads=2,
                       head_dim=16, block_size=8, dtype=jnp.bfloat16)  # fmt: skip
    dtype = fp8.kv_cache_dtype_for(fmt, jnp.bfloat16)
    k, v = fp8.quantize(batch.k_pages, 1.0, dtype), fp8.quantize(batch.v_pages, 1.0, dtype)
    with jax.default_matmul_precision("highest"):
        want, _, _ = paged_attention(batch.q, batch.k_new, batch.v_new, k, v, batch.md, scale=16**-0.5)
        got = bench._whole_prompt_reference(batch.q, batch.k_new, batch.v_new, 2, dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
