"""Per-layer count of compiled ops in a one-token decode step: no LoRA, LoRA with the separate shrink, LoRA folded.

Not a test: a measuring tool (the kernel count per layer is a proxy for launches on a GPU, where each op of
the compiled program is a kernel). Run from the repository root on CPU:
    JAX_PLATFORMS=cpu DT=float32 python tests/models/lora_hlo_count.py [dump]
(DT=bfloat16, the default, adds XLA:CPU's own bf16 -> f32 converts around dots.) ``dump`` lists the ops of one
folded layer's step.
"""
import collections
import re
import sys

sys.path.insert(0, "tests/models")
import jax, jax.numpy as jnp
from flax import nnx
from model_batch_utils import BLOCK_SIZE, NUM_BLOCKS, Chunk, block_tables, make_batch
from jaxserve.models.config import TextModelConfig
from jaxserve.models.registry import abstract_model
from jaxserve.models import lora as L
from jaxserve.pallas_kernels.attention import get_attention_fn
from jaxserve.pallas_kernels import kv_layout

def compiled(layers, use_lora, t=1, n=4, r=16, folded=False):
    cfg = TextModelConfig(architecture="llama", vocab_size=256, hidden_size=512, intermediate_size=1024,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    dtype = jnp.dtype(__import__("os").environ.get("DT", "bfloat16"))
    model = abstract_model(cfg, dtype=dtype, attention_fn=get_attention_fn("xla", "cpu"))
    graphdef, state = nnx.split(model)
    tables = block_tables(t)
    ids, md = make_batch([Chunk([5], 6, tables[i]) for i in range(t)])
    shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    page = jax.ShapeDtypeStruct(kv_layout.pages_shape(*shape, kv_layout.heads_major("xla")), dtype)
    caches = [(page, page)] * layers
    leaves = [jax.ShapeDtypeStruct(shape, dtype) for *_, shape, _ in L.layout_leaves(cfg, n, r, layers)] if use_lora else None
    if folded:
        import math
        outs = L.group_outputs(cfg)
        leaves = [jax.ShapeDtypeStruct((s[0], math.prod(outs[g][0]) + math.prod(s[1:])), dtype) if k == "A" else x
                  for (_, g, k, s, _), x in zip(L.layout_leaves(cfg, n, r, layers), leaves)]
    slots = jax.ShapeDtypeStruct(ids.shape, jnp.int32)
    def step(state, caches, ids, md, leaves, slots):
        m = nnx.merge(graphdef, state)
        kw = {"lora": L.for_layers(leaves, slots, layers)} if use_lora else {}
        hidden, caches = m(ids, caches, md, **kw)
        return m.compute_logits(hidden[md.logits_indices]), caches
    return jax.jit(step).lower(state, caches, ids, md, leaves, slots).compile().as_text()

def counts(text):
    c = collections.Counter()
    entry = text[text.index("ENTRY"):]
    for line in entry.splitlines():
        m = re.search(r"=\s*\S+(?:\[[^\]]*\])?(?:\{[^}]*\})?\s+([a-z\-]+)\(", line)
        if m and m.group(1) in ("fusion", "dot", "custom-call", "convolution"):
            kind = m.group(1)
            if kind == "fusion" and "dot_general" in line and "kCustom" in line:
                kind = "dot-fusion"
            c[kind] += 1
    return c

for t in (1,):
    for use, fo in ((False, False), (True, False), (True, True)):
        c1, c2 = counts(compiled(1, use, t, folded=fo)), counts(compiled(2, use, t, folded=fo))
        per = {k: c2[k] - c1[k] for k in set(c1) | set(c2)}
        print(f"T={t} lora={use} folded={fo}: per layer {dict(sorted(per.items()))} total(2 layers) {dict(c2)}")
if len(sys.argv) > 1:
    txt = compiled(1, True, 1, folded=True)
    entry = txt[txt.index("ENTRY"):]
    for line in entry.splitlines():
        if re.search(r"\s(fusion|dot|custom-call)\(", line):
            print(line[:220])
