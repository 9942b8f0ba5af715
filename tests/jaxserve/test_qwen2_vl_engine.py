"""Qwen2-VL through the engine: greedy tokens equal transformers' generate for prompts with 0, 1 and 2 images
(text before, between and after), batched with text-only requests, through chunked prefill with a chunk
boundary inside an image, a prefix-cache hit for the same image and a miss for another, and chat messages
with image parts."""

from __future__ import annotations

import base64
import io

import pytest
from engine_fixtures import run_cache_dir
from tiny_qwen2_vl import IMG, PH, hf_greedy, image, tiny_qwen2_vl, tiny_vl_llm

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams

N = 6  # new tokens per request


@pytest.fixture(scope="module")
def llm():
    # A 16-token budget: the first prompt's image (tokens 11..22) is cut by the first chunk's end.
    return tiny_vl_llm()


def _params():
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def _check(llm, prompts, outs):
    for p, o in zip(prompts, outs):
        images = p.get("multi_modal_data", {}).get("image", []) if isinstance(p, dict) else []
        images = images if isinstance(images, list) else [images]
        assert o.outputs[0].token_ids == hf_greedy(llm.engine_args.model, o.prompt_token_ids, images, N)


def test_images_batched_with_text_match_hf(llm):
    prompts = [
        {"prompt": f"the cat sat on the mat and the dog {PH} is on the", "multi_modal_data": {"image": image(84, 112)}},
        "hello the world of the",
        {"prompt": f"a {PH} and then {PH} end of it", "multi_modal_data": {"image": [image(84, 56, 1), image(56, 56, 2)]}},
        {"prompt": f"{PH} first", "multi_modal_data": {"image": [image(56, 84, 3)]}},
        {"prompt": "no images here at all"},
        {"prompt": f"other words {PH} same picture", "multi_modal_data": {"image": image(84, 112)}},
    ]
    before = llm.llm_engine.info()["vision"]["images_encoded"]
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    assert llm.llm_engine.info()["vision"]["images_encoded"] - before == 4  # the repeated picture: encoded once
    ids = outs[0].prompt_token_ids
    first = ids.index(IMG)
    assert first < 16 < first + 12 == len(ids) - 4  # expanded to 12 tokens; the 16-token chunk ends inside
    assert sum(t == IMG for t in outs[2].prompt_token_ids) == 6 + 4
    _check(llm, prompts, outs)


def test_prefix_cache_keys_on_image_content(llm):
    text = f"one two three four five six seven eight nine ten {PH} after the image"
    same = {"prompt": text, "multi_modal_data": {"image": image(112, 84, 7)}}
    llm.generate([same], _params(), use_tqdm=False)
    again = llm.generate([same], _params(), use_tqdm=False)[0]
    image_end = again.prompt_token_ids.index(IMG) + 12
    assert again.num_cached_tokens >= image_end  # the same image: its blocks are shared
    other = {"prompt": text, "multi_modal_data": {"image": image(112, 84, 8)}}
    miss = llm.generate([other], _params(), use_tqdm=False)[0]
    assert miss.num_cached_tokens <= miss.prompt_token_ids.index(IMG)  # text before it only
    _check(llm, [same, other], [again, miss])


def test_chat_image_parts_equal_generate(llm):
    img = image(56, 112, 4)
    png = io.BytesIO()
    img.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "look at"}, {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "and"}, {"type": "image_pil", "image_pil": image(56, 56, 5)},
    ]}]  # fmt: skip
    chat = llm.chat(messages, _params(), use_tqdm=False)[0]
    assert sum(t == IMG for t in chat.prompt_token_ids) == 8 + 4
    _check(llm, [{"multi_modal_data": {"image": [img, image(56, 56, 5)]}}], [chat])


def test_bad_multimodal_prompts_raise(llm):
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate({"prompt": f"{PH} {PH} {PH}", "multi_modal_data": {"image": [image(56, 56)] * 3}}, _params())
    with pytest.raises(ValueError, match="no image was given"):
        llm.generate({"prompt": f"{PH} alone"}, _params())
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": image(56, 56)}}, _params())
    with pytest.raises(ValueError, match="network fetches are off"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])


def test_tensor_parallel_matches_hf():
    """TP=2: the tower replicated, the decoder sharded by heads. (enforce_eager gives the same tokens too, by
    hand: 13 s of unjitted CPU ops, too slow to run here.)"""
    llm = LLM(
        tiny_qwen2_vl(), dtype="float32", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2,
        block_size=4, compilation_cache_dir=run_cache_dir(), use_tqdm_on_load=False, precompile="none", tensor_parallel_size=2,
    )  # fmt: skip
    prompts = [{"prompt": f"the cat {PH} is on", "multi_modal_data": {"image": image(56, 84)}}]
    _check(llm, prompts, llm.generate(prompts, _params(), use_tqdm=False))
