"""The Hugging Face loader: sharded checkpoints, bf16, clear errors for mismatched or missing files;
and the dummy loader."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_batch_utils import Chunk, Runner, block_tables
from safetensors.numpy import load_file, save_file
from tiny_models import hf_logits, make_tiny_checkpoint

from jaxserve.models.config import TextModelConfig
from jaxserve.models.loader.dummy import load_dummy_model
from jaxserve.models.loader.hf import load_hf_model, read_hf_config
from jaxserve.models.loader.weights import load_from_hf_tensors
from jaxserve.pallas_kernels.attention import paged_attention

PROMPT = list(range(5, 17))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama_gqa")


def _logits(model, prompt=PROMPT):
    (out,) = Runner(model).run([Chunk(prompt, 0, block_tables(1)[0])])
    return out


def _load(path, dtype=jnp.float32):
    return load_hf_model(path, dtype=dtype, attention_fn=paged_attention)


def _rewrite(src, dst, edit):
    """Copy a single-file checkpoint, applying ``edit`` to its tensor dict."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_sharded_checkpoint_loads(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "sharded", "llama_gqa", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 1
    model, cfg = _load(path)
    assert cfg.architecture == "llama" and cfg.num_key_value_heads == 2
    np.testing.assert_allclose(_logits(model), hf_logits(path, PROMPT), atol=1e-4, rtol=0)


def test_bf16_checkpoint_loads_in_both_dtypes(tmp_path, tiny_dir):
    import torch  # test-only: the reference writes the bf16 checkpoint
    from transformers import AutoModelForCausalLM

    path = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).save_pretrained(path)
    shutil.copy(tiny_dir / "tokenizer.json", path)
    model32, cfg = _load(path, jnp.float32)
    assert cfg.checkpoint_dtype == "bfloat16"
    model16, _ = _load(path, jnp.bfloat16)
    params16 = jax.tree.leaves(nnx.state(model16))
    assert all(p.dtype == jnp.bfloat16 for p in params16)
    ref = hf_logits(tiny_dir, PROMPT)  # the fp32 original: bf16 weights are close, not equal
    np.testing.assert_allclose(_logits(model32), ref, atol=0.1, rtol=0)
    np.testing.assert_allclose(_logits(model16), ref, atol=0.3, rtol=0)


def test_missing_tensor_is_named(tmp_path, tiny_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _rewrite(tiny_dir, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing tensors \[model\.layers\.1\.mlp\.up_proj\.weight\]"):
        _load(path)


def test_wrong_shape_is_named(tmp_path, tiny_dir):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(t):
        t[name] = np.zeros((16, 64), np.float32)  # expected (32, 64): 2 kv heads x head_dim 16

    path = _rewrite(tiny_dir, tmp_path / "wrong", edit)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(16, 64\).*expected \(32, 64\)"):
        _load(path)


def test_unexpected_tensor_raises_but_known_extras_do_not(tmp_path, tiny_dir):
    def add_extra(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    _load(_rewrite(tiny_dir, tmp_path / "extra_ok", add_extra))

    def add_unknown(t):
        t["model.layers.2.mlp.up_proj.weight"] = np.ones((128, 64), np.float32)

    with pytest.raises(ValueError, match=r"unexpected tensors \[model\.layers\.2\.mlp\.up_proj\.weight\]"):
        _load(_rewrite(tiny_dir, tmp_path / "extra_bad", add_unknown))


def test_missing_files_say_what_was_looked_for(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        _load(tmp_path / "empty")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_dir / "config.json", no_weights)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        _load(no_weights)


def test_generation_config_eos_ids_are_merged(tmp_path, tiny_dir):
    path = shutil.copytree(tiny_dir, tmp_path / "eos")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1, 7]}))
    assert read_hf_config(path).eos_token_ids == (1, 7)


def test_dummy_model_gives_finite_logits(tiny_dir):
    cfg = read_hf_config(tiny_dir)
    model = load_dummy_model(cfg, dtype=jnp.bfloat16, attention_fn=paged_attention, seed=3)
    logits = _logits(model)
    assert logits.shape == (len(PROMPT), cfg.vocab_size)
    assert np.isfinite(logits).all() and logits.std() > 0


def test_dummy_model_is_seeded(tiny_dir):
    cfg = TextModelConfig.from_hf_config(json.loads((tiny_dir / "config.json").read_text()))
    a, b = (load_dummy_model(cfg, dtype=jnp.float32, attention_fn=paged_attention, seed=s) for s in (0, 0))
    leaf = lambda m: np.asarray(m.model.layers[0].self_attn.qkv_proj.kernel[...])  # noqa: E731
    np.testing.assert_array_equal(leaf(a), leaf(b))


def test_stream_of_pairs_loads_and_is_checked(tiny_dir):
    # The GGUF reader yields (hf_name, array) pairs one at a time, in file order.
    cfg = read_hf_config(tiny_dir)
    tensors = load_file(tiny_dir / "model.safetensors")
    pairs = list(reversed(tensors.items()))
    model = load_from_hf_tensors(cfg, iter(pairs), dtype=jnp.float32, attention_fn=paged_attention)
    np.testing.assert_allclose(_logits(model), hf_logits(tiny_dir, PROMPT), atol=1e-4, rtol=0)

    with pytest.raises(ValueError, match=r"missing tensors \[model\.norm\.weight\]"):
        load_from_hf_tensors(cfg, iter([p for p in pairs if p[0] != "model.norm.weight"]),
                             dtype=jnp.float32, attention_fn=paged_attention)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.extra\.weight'"):
        load_from_hf_tensors(cfg, iter([("model.extra.weight", np.ones(3))] + pairs),
                             dtype=jnp.float32, attention_fn=paged_attention)



@pytest.mark.parametrize("loader", ["safetensors", "dummy"])
def test_weight_progress_bar_counts_the_model_bytes(tiny_dir, monkeypatch, loader):
    """progress=True draws a bar over the parameters' bytes that ends at the model's size; False hides it."""
    from jaxserve.model_loader import load_model
    from jaxserve.models.loader import weights

    bars = []

    class Recording(weights.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.hidden = kwargs["disable"]  # close() sets .disable itself
            bars.append(self)

    monkeypatch.setattr(weights, "tqdm", Recording)
    for progress in (False, True):
        model, _ = load_model(
            str(tiny_dir), loader, dtype=jnp.bfloat16, attention_fn=paged_attention, progress=progress
        )
        assert bars[-1].hidden == (not progress)
    total = weights.param_bytes(model)
    assert total == sum(x.size * 2 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))  # bfloat16
    assert bars[-1].total == bars[-1].n == total
