"""One sequence's 1-token decode attention on the CPU over token-major and heads-major pages (kv_layout.py).

    python -m jaxserve.bench.cpu_page_layout [CONTEXT_LEN]

A 30-layer chain at SmolLM2-135M's widths (3 KV heads, 3 query heads each, head_dim 64, pages of 16, a
256-token width): each layer streams 14 MB of weights (so the pages are cold, as in the engine), writes its
new K and V first and then attends, as the xla backend does. Prints each layout's cost per layer beyond a chain
without attention (median and best of the runs, alternated; docs/BENCHMARKS.md §34). ``early`` is heads-major
pages gathered at the start of each layer, before its KV write (the new token patched into the gathered
context), so that the gather may run beside the layer's products (§35). ``native`` is heads-major pages read in place by the C++ kernel
(cpu_native.py; §36). ``--trace`` also profiles ten calls of
each and sums the time by XLA op kind.
"""
import os, sys, time, statistics
import numpy as np
import jax, jax.numpy as jnp

L, P, B, K, G, D, N, HID = 30, 16, 16, 3, 3, 64, 512, 576
C = B * P
HI = jax.lax.Precision.HIGHEST
LEN = 200  # set by main()
table = slot = None


def softmax_pv(sc, v_seq, eq):
    vis = (jnp.arange(C) < LEN)[None, :, None]
    sc = jnp.where(vis, sc * 0.125, -1e30)
    p = jnp.where(vis, jnp.exp(sc - sc.max(axis=1, keepdims=True)), 0.0)
    return jnp.einsum(eq, p, v_seq, precision=HI) / p.sum(axis=1)[..., None]


def layer_tm(kp, vp, q, kn, vn):  # [N, P, K, D]
    kp = kp.reshape(N * P, K, D).at[jnp.stack([slot, N * P])].set(jnp.stack([kn, kn]), mode="drop").reshape(N, P, K, D)
    vp = vp.reshape(N * P, K, D).at[jnp.stack([slot, N * P])].set(jnp.stack([vn, vn]), mode="drop").reshape(N, P, K, D)
    k_seq, v_seq = kp[table].reshape(C, K, D), vp[table].reshape(C, K, D)
    sc = jnp.einsum("ckd,kgd->kcg", k_seq, q, precision=HI)
    return softmax_pv(sc, v_seq, "kcg,ckd->kgd"), kp, vp


def write_hm(kp, vp, kn, vn, at=None):  # [N, K, P, D]; ``at``: the slot (default: the sequence's next)
    at = slot if at is None else at
    blk, off = at // P, at % P
    kp = kp.at[jnp.stack([blk, N]), :, jnp.stack([off, 0])].set(jnp.stack([kn, kn]), mode="drop")
    vp = vp.at[jnp.stack([blk, N]), :, jnp.stack([off, 0])].set(jnp.stack([vn, vn]), mode="drop")
    return kp, vp


def layer_hm(kp, vp, q, kn, vn):  # [N, K, P, D]
    kp, vp = write_hm(kp, vp, kn, vn)
    k_seq = kp[table].transpose(1, 0, 2, 3).reshape(K, C, D)
    v_seq = vp[table].transpose(1, 0, 2, 3).reshape(K, C, D)
    sc = jnp.einsum("kcd,kgd->kcg", k_seq, q, precision=HI)
    return softmax_pv(sc, v_seq, "kcg,kcd->kgd"), kp, vp


def layer_native(kp, vp, q, kn, vn):  # [N, K, P, D], read in place by the C++ kernel (cpu_native.py)
    from jaxserve.pallas_kernels import cpu_native

    kp, vp = write_hm(kp, vp, kn, vn)
    o = cpu_native.decode_attention(q[None], kp, vp, table[None], jnp.asarray([LEN], jnp.int32), scale=0.125,
                                    sliding_window=None)
    return o[0], kp, vp


def layer_none(kp, vp, q, kn, vn):
    return q, kp, vp


def _tie(a, b):
    """``a``, made to depend on ``b`` (a scalar) without changing it: XLA orders ops by data only. A NaN in
    ``b`` cannot move ``a`` either (min(a, a + 1) = a)."""
    return jnp.minimum(a, a + jnp.isnan(b).astype(a.dtype))


def make_early():
    """Heads-major pages gathered at the layer's start, before the layer's KV write, which waits for the
    gathers (or XLA copies the whole cache to keep the old one alive); the new key and value are patched in."""
    def f(kps, vps, ws, w2, x):
        kps, vps = list(kps), list(vps)
        for i in range(L):
            tab = _tie(table, x[0, 0])  # not before the layer starts: the gather should overlap its products
            k_old = kps[i][tab].transpose(1, 0, 2, 3).reshape(K, C, D)
            v_old = vps[i][tab].transpose(1, 0, 2, 3).reshape(K, C, D)
            h = jnp.dot(x, ws[i])
            qkv = jnp.dot(h, w2[i])[0]
            q = qkv[: K * G * D].reshape(K, G, D)
            kn = qkv[K * G * D: (K * G + K) * D].reshape(K, D)
            vn = qkv[(K * G + K) * D:].reshape(K, D)
            kps[i], vps[i] = write_hm(kps[i], vps[i], kn, vn, _tie(slot, k_old[0, 0, 0] + v_old[0, 0, 0]))
            new = (jnp.arange(C) == LEN - 1)[None, :, None]
            k_seq, v_seq = jnp.where(new, kn[:, None, :], k_old), jnp.where(new, vn[:, None, :], v_old)
            sc = jnp.einsum("kcd,kgd->kcg", k_seq, q, precision=HI)
            x = x + softmax_pv(sc, v_seq, "kcg,kcd->kgd").reshape(1, K * G * D)[:, :HID] * 1e-3
        return x, kps, vps
    return jax.jit(f, donate_argnums=(0, 1))


def make(att):
    @jax.jit
    def f(kps, vps, ws, w2, x):  # caches donated below
        kps, vps = list(kps), list(vps)
        for i in range(L):
            h = jnp.dot(x, ws[i])
            qkv = jnp.dot(h, w2[i])[0]
            q = qkv[: K * G * D].reshape(K, G, D)
            kn = qkv[K * G * D: (K * G + K) * D].reshape(K, D)
            vn = qkv[(K * G + K) * D:].reshape(K, D)
            o, kps[i], vps[i] = att(kps[i], vps[i], q, kn, vn)
            x = x + o.reshape(1, K * G * D)[:, :HID] * 1e-3
        return x, kps, vps
    return jax.jit(f.__wrapped__ if hasattr(f, '__wrapped__') else f, donate_argnums=(0, 1))


def main() -> None:
    global LEN, table, slot
    LEN = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 200
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(N)[:B].astype(np.int32))
    slot = table[(LEN - 1) // P] * P + (LEN - 1) % P
    ws = [jnp.asarray(rng.standard_normal((HID, 3072)) * 0.02, jnp.float32) for _ in range(L)]
    w2 = [jnp.asarray(rng.standard_normal((3072, (K * G + 2 * K) * D)) * 0.02, jnp.float32) for _ in range(L)]
    from jaxserve.pallas_kernels import cpu_native

    variants = {"tm": layer_tm, "hm": layer_hm, "early": None, "none": layer_none}
    if cpu_native.available():
        variants = {"native": layer_native, **variants}
    caches = {}
    base_k = rng.standard_normal((N, P, K, D)).astype(np.float32)
    for name in variants:
        tr = (lambda a: a) if name == "tm" else (lambda a: a.transpose(0, 2, 1, 3))
        caches[name] = ([jnp.asarray(tr(base_k)) for _ in range(L)], [jnp.asarray(tr(base_k)) for _ in range(L)])
    fs = {k: make_early() if k == "early" else make(v) for k, v in variants.items()}
    x0 = jnp.ones((1, HID), jnp.float32)
    outs = {}
    def run(k):
        x, kk, vv = fs[k](*caches[k], ws, w2, x0)
        caches[k] = (kk, vv)
        return x
    for k in fs:
        outs[k] = run(k)
    for k in ("hm", "early", "native"):
        if k in outs:
            np.testing.assert_allclose(np.asarray(outs[k]), np.asarray(outs["tm"]), rtol=1e-5, atol=1e-6)
    times = {k: [] for k in fs}
    for _ in range(int(os.environ.get("REPS", 40))):
        for k, f in fs.items():
            t0 = time.perf_counter(); jax.block_until_ready(run(k)); times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["none"]); bmin = min(times["none"])
    for k, t in times.items():
        m = statistics.median(t)
        print(f"{k:5s} median {m*1e3:7.2f} ms  min {min(t)*1e3:7.2f}  attention/layer median {(m-base)/L*1e6:6.1f} us, min {(min(t)-bmin)/L*1e6:6.1f} us")
    if "--trace" in sys.argv:
        import collections, json, re, subprocess, tempfile
        for k in ("tm", "hm", "early", "native"):
            if k not in fs:
                continue
            d = tempfile.mkdtemp(prefix=f"page_layout_{k}_")
            with jax.profiler.trace(d):
                for _ in range(10):
                    jax.block_until_ready(run(k))
            subprocess.run([sys.executable, "-m", "jaxserve.bench.trace", d, "--top", "2000", "--json", d + "/sum.json"],
                           capture_output=True, check=True)
            kinds = collections.Counter()
            for name, ms, _ in json.load(open(d + "/sum.json"))["host_top"]:
                if "fusion" in name or name.startswith(("dot", "wrapped", "copy")):
                    kinds[re.sub(r"[.\d]+$", "", name)] += ms / 10
            print(k, " ".join(f"{n}={v:.2f}ms" for n, v in kinds.most_common(6)))


if __name__ == "__main__":
    main()
