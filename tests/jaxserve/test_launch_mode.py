"""The command-buffer policy (jaxserve.launch_mode): which programs launch kernel by kernel on a GPU."""

from __future__ import annotations

import pytest

from jaxserve import launch_mode

NO_CB = {"xla_gpu_enable_command_buffer": ""}


@pytest.mark.parametrize(
    "mode, host_bound, expected",
    [("auto", True, NO_CB), ("auto", False, None), ("always", True, None), ("never", False, NO_CB)],
)
def test_gpu_policy(monkeypatch, mode, host_bound, expected):
    monkeypatch.setenv("JAXSERVE_COMMAND_BUFFERS", mode)
    assert launch_mode.compiler_options("gpu", host_bound) == expected
    assert launch_mode.describe(expected) == ("-nocb" if expected else "")


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_other_platforms_keep_xla_defaults(monkeypatch, platform):
    monkeypatch.setenv("JAXSERVE_COMMAND_BUFFERS", "never")
    assert launch_mode.compiler_options(platform, True) is None


def test_bad_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("JAXSERVE_COMMAND_BUFFERS", "off")
    with pytest.raises(ValueError, match=r"JAXSERVE_COMMAND_BUFFERS='off' is not one of auto, always, never"):
        launch_mode.compiler_options("gpu", True)


def test_the_option_compiles_on_this_backend():
    """XLA parses the option on every backend (it is a DebugOptions field), so a program compiled with it runs."""
    import jax
    import jax.numpy as jnp

    program = jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(4)).compile(NO_CB)
    assert program(jnp.ones(4)).tolist() == [3.0] * 4
