"""Qwen2-VL's host-side batching: LLM.generate's threaded image preprocessing keeps the first bad prompt's error."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_qwen2_vl import image, tiny_qwen2_vl

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams

N = 4  # new tokens per request
PH = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def llm():
    # A 48-token budget: the first step holds three new images, of two patch buckets, and cuts the third.
    # No prefix caching, so a second run of the same prompts encodes the images again.
    return LLM(
        tiny_qwen2_vl(), dtype="float32", max_model_len=128, max_num_batched_tokens=48, max_num_seqs=8,
        block_size=4, compilation_cache_dir="", use_tqdm_on_load=False, limit_mm_per_prompt={"image": 2},
        precompile="none", enable_prefix_caching=False,
    )  # fmt: skip


def _params():
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def _prompts():
    return [
        {"prompt": f"the cat sat on the mat {PH} is on", "multi_modal_data": {"image": image(112, 112, 11)}},
        {"prompt": f"a {PH} and then {PH} end", "multi_modal_data": {"image": [image(56, 56, 12), image(112, 168, 13)]}},
        {"prompt": f"{PH} first", "multi_modal_data": {"image": image(84, 112, 14)}},
        "hello the world of the",
        {"prompt": f"other words {PH} same picture", "multi_modal_data": {"image": image(112, 112, 11)}},
    ]


def test_a_bad_image_fails_its_prompt_before_anything_is_queued(llm):
    prompts = _prompts()
    bad = np.zeros((8, 8, 3), np.float32)  # not uint8: the processor refuses it
    prompts[3] = {"prompt": f"x {PH}", "multi_modal_data": {"image": bad}}
    prompts[4] = {"prompt": f"y {PH}", "multi_modal_data": {"image": "not an image"}}  # later: not reported
    with pytest.raises(ValueError, match=r"^prompt 3: image 0: an array image must be"):
        llm.generate(prompts, _params(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
