"""Qwen2-VL image preprocessing: equal to transformers' processor, and torch-free."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from PIL import Image
from transformers import Qwen2VLImageProcessor as HFProcessor  # the default class (without torchvision: PIL)

from jaxserve.models.qwen2_vl_image import Qwen2VLImageProcessor


def _images():
    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 255, (300, 451, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 255, (56, 30, 3), dtype=np.uint8)),  # smaller than one merge window
    ]


def test_matches_hf_processor_with_pixel_limits():
    limits = dict(min_pixels=56 * 56, max_pixels=200 * 200)
    pixels, grid = Qwen2VLImageProcessor(**limits)(_images())
    want = HFProcessor(**limits)(images=_images(), return_tensors="np")
    np.testing.assert_array_equal(grid, np.asarray(want["image_grid_thw"]))
    np.testing.assert_array_equal(pixels, np.asarray(want["pixel_values"]))
    assert pixels.shape == (int(np.prod(grid, axis=1).sum()), 3 * 2 * 14 * 14)
    assert (grid[:, 1] * grid[:, 2] * 14 * 14 <= 200 * 200).all()  # max_pixels bounds the resize
    assert (grid[:, 1] * grid[:, 2] * 14 * 14 >= 56 * 56).all()  # and min_pixels grows the tiny one
    assert Qwen2VLImageProcessor(**limits).num_image_tokens(grid) == [int(t * h * w) // 4 for t, h, w in grid]


def test_runs_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['torchvision'] = None\n"
        "import numpy as np\n"
        "from jaxserve.models.qwen2_vl_image import Qwen2VLImageProcessor\n"
        "p, g = Qwen2VLImageProcessor()([np.zeros((64, 64, 3), np.uint8)])\n"
        "print(g.tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[[1, 4, 4]]")


def test_grid_from_the_size_alone_matches_the_processor():
    """The placeholders are counted before the pixels exist (they are computed in the background)."""
    for limits in ({}, dict(min_pixels=56 * 56, max_pixels=200 * 200)):
        proc = Qwen2VLImageProcessor(**limits)
        assert proc.grids_known_early
        for image in _images() + [Image.new("RGB", (1920, 1080)), Image.new("RGB", (28, 900))]:
            assert proc.grid_thw(image) == tuple(int(x) for x in proc([image])[1][0])


def test_pixels_computed_in_the_background_equal_the_processors():
    import concurrent.futures

    from jaxserve.multimodal import MultiModalProcessor

    class _Cfg:  # the fields MultiModalProcessor reads
        image_token_id, vision_start_token_id, vision_end_token_id = 9, 8, 10

        class vision:
            spatial_merge_size, patch_size = 2, 14

    mm = MultiModalProcessor(None, _Cfg())
    images = _images()
    ids, inputs = mm.process([1, 8, 9, 10, 2, 8, 9, 10, 3], images)
    want, grids = Qwen2VLImageProcessor()(images)
    assert all(isinstance(item.pixels, concurrent.futures.Future) for item in inputs.images)
    got = np.concatenate([item.pixel_values for item in inputs.images])
    np.testing.assert_array_equal(got, want)
    assert [item.grid_thw for item in inputs.images] == [tuple(g) for g in grids.tolist()]
    assert ids.count(9) == sum(item.num_tokens for item in inputs.images)
