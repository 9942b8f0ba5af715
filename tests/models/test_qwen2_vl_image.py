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
