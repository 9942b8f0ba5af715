"""The on-disk store of compiled programs: hits, misses, a changed fingerprint, a corrupt entry."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.executable_store import ExecutableStore

DEVICES = jax.devices()[:1]  # where jit placed the programs below


def _program(n: int):
    return jax.jit(lambda w, x: jnp.tanh(x @ w) * 2.0).lower(jnp.ones((n, n)), jnp.ones((2, n))).compile()


def test_round_trip_and_fingerprint(tmp_path):
    store = ExecutableStore(str(tmp_path), {"model": "a"})
    assert store.load("step", DEVICES) is None and store.misses == 1
    store.save("step", _program(8))
    loaded = ExecutableStore(str(tmp_path), {"model": "a"}).load("step", DEVICES)
    w, x = jnp.full((8, 8), 0.1), jnp.arange(16.0).reshape(2, 8)
    np.testing.assert_array_equal(np.asarray(loaded(w, x)), np.asarray(_program(8)(w, x)))
    # Another context (model, shapes, shardings...) is another program: never served this entry.
    assert ExecutableStore(str(tmp_path), {"model": "b"}).load("step", DEVICES) is None


def test_corrupt_entry_is_recompiled_not_fatal(tmp_path, caplog):
    store = ExecutableStore(str(tmp_path), {"model": "a"})
    store.save("step", _program(4))
    (entry,) = tmp_path.glob("step-*.jxe")
    entry.write_bytes(entry.read_bytes()[:100])  # a write cut short (a full disk, a killed process)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert store.load("step", DEVICES) is None
    assert "compiling it again" in caplog.text


@pytest.mark.parametrize("cache_dir, platform", [(None, "gpu"), ("", "gpu"), ("x", "cpu")])
def test_not_used_without_a_cache_dir_or_on_cpu(tmp_path, cache_dir, platform):
    root = str(tmp_path / cache_dir) if cache_dir else cache_dir
    assert ExecutableStore.open(root, platform, {}) is None
