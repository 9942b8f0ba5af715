"""jaxserve's float32 logits equal transformers' for every supported architecture variant, through the
paged cache: a whole prompt, prefill then decode, and a ragged batch with a chunked prefill."""

import jax.numpy as jnp
import numpy as np
import pytest
from model_batch_utils import Chunk, Runner, block_tables
from tiny_models import VARIANTS, hf_logits, make_tiny_checkpoint

from jaxserve.models.loader.hf import load_hf_model
from jaxserve.pallas_kernels.attention import paged_attention

ATOL = 1e-4
PROMPT_A = np.random.default_rng(1).integers(2, 512, size=20).tolist()
PROMPT_B = np.random.default_rng(2).integers(2, 512, size=13).tolist()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    model, cfg = load_hf_model(path, dtype=jnp.float32, attention_fn=paged_attention)
    ref_a, ref_b = hf_logits(path, PROMPT_A), hf_logits(path, PROMPT_B)
    # Logits must be O(1), or a tolerance of 1e-4 would not tell right from wrong.
    assert ref_a.std() > 0.1
    return model, cfg, ref_a, ref_b


def test_whole_prompt(variant):
    model, _, ref_a, _ = variant
    (out,) = Runner(model).run([Chunk(PROMPT_A, 0, block_tables(1)[0])])
    np.testing.assert_allclose(out, ref_a, atol=ATOL, rtol=0)


def test_prefill_then_decode(variant):
    model, _, ref_a, _ = variant
    runner, table = Runner(model), block_tables(1, seed=3)[0]
    n = len(PROMPT_A)
    (prefill,) = runner.run([Chunk(PROMPT_A[:-1], 0, table)])
    (decode,) = runner.run([Chunk(PROMPT_A[-1:], n - 1, table)])
    np.testing.assert_allclose(prefill, ref_a[:-1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(decode, ref_a[-1:], atol=ATOL, rtol=0)


def test_ragged_batch_with_chunked_prefill(variant):
    # Step 1: the first 12 tokens of A. Step 2: the rest of A alongside all of B, plus padding tokens.
    model, _, ref_a, ref_b = variant
    runner = Runner(model)
    table_a, table_b = block_tables(2, seed=4)
    runner.run([Chunk(PROMPT_A[:12], 0, table_a)])
    out_a, out_b = runner.run([Chunk(PROMPT_A[12:], 12, table_a), Chunk(PROMPT_B, 0, table_b)])
    np.testing.assert_allclose(out_a, ref_a[12:], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out_b, ref_b, atol=ATOL, rtol=0)
