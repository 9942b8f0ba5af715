"""Parameters carry logical axis names, and both loaders can place them on a mesh as they load."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from model_batch_utils import Chunk, Runner, block_tables
from tiny_models import hf_logits, make_tiny_checkpoint

from jaxserve.models.loader.dummy import load_dummy_model
from jaxserve.models.loader.hf import load_hf_model
from jaxserve.models.registry import abstract_model
from jaxserve.pallas_kernels.attention import paged_attention

# A stand-in for the real rules table (owned elsewhere): TP over heads, MLP and vocab.
RULES = {"q_heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
NAMES = {"vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp"}


def _shardings_fn(mesh):
    def fn(abstract):
        def place(v):
            names = v.get_metadata()["out_sharding"]
            return v.replace(NamedSharding(mesh, PartitionSpec(*(RULES.get(n) for n in names))))

        return jax.tree.map(place, nnx.state(abstract), is_leaf=lambda x: isinstance(x, nnx.Variable))

    return fn


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((1, 2), ("data", "model"), axis_types=auto, devices=jax.devices()[:2])


def test_every_param_has_known_axis_names(tmp_path):
    from jaxserve.models.loader.hf import read_hf_config

    cfg = read_hf_config(make_tiny_checkpoint(tmp_path, "qwen3_qknorm"))
    state = nnx.state(abstract_model(cfg, dtype=jnp.float32, attention_fn=paged_attention))
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == len(var.get_value().shape) and set(names) - {None} <= NAMES, (path, names)


def test_hf_and_dummy_loads_are_sharded(tmp_path, mesh):
    path = make_tiny_checkpoint(tmp_path, "llama_gqa")
    model, cfg = load_hf_model(path, dtype=jnp.float32, attention_fn=paged_attention, shardings_fn=_shardings_fn(mesh))
    kernel = model.model.layers[0].self_attn.qkv_proj.kernel[...]  # [D, K, G+2, Dh]: KV groups split
    assert kernel.sharding.spec == PartitionSpec(None, "model", None, None)
    prompt = list(range(5, 17))
    (out,) = Runner(model).run([Chunk(prompt, 0, block_tables(1)[0])])
    np.testing.assert_allclose(out, hf_logits(path, prompt), atol=1e-4, rtol=0)

    dummy = load_dummy_model(cfg, dtype=jnp.bfloat16, attention_fn=paged_attention, shardings_fn=_shardings_fn(mesh))
    assert dummy.model.layers[0].mlp.down_proj.kernel[...].sharding.spec == PartitionSpec("model", None)
