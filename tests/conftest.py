"""Shared test set-up: CPU JAX, the tests folder importable (for tests/tiny_models.py)."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several fake CPU devices, for the sharding tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(__file__))
