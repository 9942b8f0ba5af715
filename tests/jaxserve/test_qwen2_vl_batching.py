"""Qwen2-VL's host-side batching: a step's uncached images go through the tower together (one call per patch
bucket), giving HF's greedy tokens and the one-image-per-call path's, with a chunk boundary inside an image;
and LLM.generate's threaded image preprocessing keeps prompt order and the first bad prompt's error, and decodes
a lazily opened image shared by several prompts once (two threads reading its file at once would fail)."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_qwen2_vl import IMG, PH, hf_greedy, image, tiny_vl_llm

from jaxserve import vision_runner
from jaxserve.sampling_params import SamplingParams

N = 4  # new tokens per request


@pytest.fixture(scope="module")
def llm():
    # A 48-token budget: the first step holds three new images, of two patch buckets, and cuts the third.
    # No prefix caching, so a second run of the same prompts encodes the images again.
    return tiny_vl_llm(max_model_len=128, max_num_batched_tokens=48, enable_prefix_caching=False)


def _params():
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def _prompts():
    return [
        {"prompt": f"the cat sat on the mat {PH} is on", "multi_modal_data": {"image": image(112, 112, 11)}},
        {"prompt": f"a {PH} and then {PH} end",
         "multi_modal_data": {"image": [image(56, 56, 12), image(112, 168, 13)]}},  # fmt: skip
        {"prompt": f"{PH} first", "multi_modal_data": {"image": image(84, 112, 14)}},
        "hello the world of the",
        {"prompt": f"other words {PH} same picture", "multi_modal_data": {"image": image(112, 112, 11)}},
    ]


def _run(llm, prompts):
    vision = llm.llm_engine.runner.vision
    before = vision.num_encoded, vision.num_encode_calls
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    return outs, vision.num_encoded - before[0], vision.num_encode_calls - before[1]


def _forget_images(llm):
    vision = llm.llm_engine.runner.vision
    vision.entries.clear()
    vision.free_rows = list(range(vision.num_rows - 1, -1, -1))


def test_a_steps_images_share_calls_and_match_hf_and_one_per_call(llm, monkeypatch):
    prompts = _prompts()
    outs, encoded, calls = _run(llm, prompts)
    # Step 1: the 64-row bucket's two images in one call, the 128-row one (cut by the chunk's end) in another;
    # step 2: the fourth image. The repeated picture is a cache hit.
    assert (encoded, calls) == (4, 3)
    assert [o.prompt_token_ids for o in outs] == [llm.llm_engine.prepare_prompt(p)[1] for p in prompts]  # order
    ids = outs[1].prompt_token_ids
    second = ids.index(IMG, ids.index(IMG) + 4)  # the second image's first token (the first has 4)
    cut = 48 - len(outs[0].prompt_token_ids)  # where step 1 ends in prompt 1
    assert second < cut < second + 24  # inside the second image (24 tokens)
    for p, o in zip(prompts, outs):
        images = p.get("multi_modal_data", {}).get("image", []) if isinstance(p, dict) else []
        images = images if isinstance(images, list) else [images]
        assert o.outputs[0].token_ids == hf_greedy(llm.engine_args.model, o.prompt_token_ids, images, N)
    _forget_images(llm)
    monkeypatch.setattr(vision_runner, "_MAX_BATCH_ROWS", 1)  # one image per call, as before batching
    single, encoded, calls = _run(llm, prompts)
    assert encoded == calls == 4
    assert [o.outputs[0].token_ids for o in single] == [o.outputs[0].token_ids for o in outs]


def test_a_bad_image_fails_its_prompt_before_anything_is_queued(llm):
    prompts = _prompts()
    bad = np.zeros((8, 8, 3), np.float32)  # not uint8: the processor refuses it
    prompts[3] = {"prompt": f"x {PH}", "multi_modal_data": {"image": bad}}
    prompts[4] = {"prompt": f"y {PH}", "multi_modal_data": {"image": "not an image"}}  # later: not reported
    with pytest.raises(ValueError, match=r"^prompt 3: image 0: an array image must be"):
        llm.generate(prompts, _params(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_one_opened_file_in_many_prompts_preprocesses_as_one_thread_does(llm, tmp_path):
    """The same lazily opened image in several prompts: decoded once before the threads start, each prompt's
    pixel rows are the single-threaded ones."""
    from PIL import Image

    from jaxserve.llm import _preparer

    image(448, 448, 21).save(tmp_path / "a.png")  # large enough that two threads decoding it would collide
    opened = Image.open(tmp_path / "a.png")  # not decoded yet
    prompts = [{"prompt": f"w{k} {PH}", "multi_modal_data": {"image": opened}} for k in range(6)]
    engine = llm.llm_engine
    with _preparer(engine, prompts) as prepare:
        got = [prepare(i) for i in range(len(prompts))]
    want = engine.prepare_prompt({"prompt": f"w0 {PH}", "multi_modal_data": {"image": Image.open(tmp_path / "a.png")}})
    for _, ids, mm in got:
        assert ids.count(IMG) == want[1].count(IMG) == 256 and mm.images[0].hash == want[2].images[0].hash
        np.testing.assert_array_equal(mm.images[0].pixel_values, want[2].images[0].pixel_values)
