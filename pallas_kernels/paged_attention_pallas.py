"""Pallas ragged paged attention: the engine's entry point for ``attention_backend="pallas"``.

One call serves a ragged batch of any mix. On GPU two Pallas kernels split the work by query length,
both sized from static shapes alone:
- sequences with at most ``q_per_seq`` new tokens (decodes) go to the split-context decode kernel
  (``triton_decode``, Triton lowering), which reads each KV page once per KV head; over an fp8 cache on
  Hopper, to the Mosaic GPU one (``mosaic_decode``: a TMA ring of raw fp8 tiles, wgmma) when the shapes
  suit it (``GpuKernelConfig.decode_impl``);
- longer ones (prefill chunks) go to a causal flash kernel: on Hopper the Mosaic GPU one
  (``mosaic_prefill``: wgmma and TMA), elsewhere, or for shapes it does not take, the Triton one
  (``triton_prefill``). ``GpuKernelConfig.prefill_impl`` overrides the choice.
Each kernel's programs for the other kind of sequence exit at once, so a pure decode or pure prefill
step pays only an empty launch for the other. On TPU the same interface calls jax's
``ragged_paged_attention`` Pallas TPU op (``tpu_ragged_adapter``).

The KV write runs ahead of the kernels as a small Pallas kernel of whole-row copies (``kv_write``), in
place on the donated cache. Fusing it into the attention kernels would save at most its own time: ~1 µs
in a decode step, but XLA's scatter took over a quarter of a long prefill's attention call, hence the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import fp8, kv_layout, kv_write, mosaic_decode, mosaic_prefill
from jaxserve.pallas_kernels import precision as prec
from jaxserve.pallas_kernels import triton_common as tc
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.pallas_kernels.reference import write_kv
from jaxserve.pallas_kernels.triton_decode import decode_attention
from jaxserve.pallas_kernels.triton_prefill import prefill_attention


@dataclasses.dataclass(frozen=True)
class GpuKernelConfig:
    """Static tuning knobs of the GPU kernels; None picks the default from the shapes."""

    decode_tile_tokens: int = 64  # KV tokens per decode loop step (capped to fit shared memory)
    decode_splits: int | None = None  # context splits per sequence
    decode_warps: int = 2
    # 1: no software pipelining; 8% faster than 2 through the whole entry point on the H200 (2026-11-29),
    # presumably because half the shared memory per program lets twice as many programs share an SM.
    decode_stages: int = 1
    decode_heads_inner: bool = True  # grid order: the K programs of one sequence launch side by side
    # Over an fp8 cache with a bfloat16 q: the decode products' operand type, "query" (bfloat16) or
    # "float16": fp8 tiles convert to float16 in fewer instructions (e5m2 is float16's top byte), and the
    # kernel measured 1.39-1.43x bf16's speed against 1.05-1.14x with bfloat16 products (H200, 2026-12-01);
    # float16 also keeps more of q's and p's mantissa. q's range is then float16's (+-65504).
    fp8_decode_compute: str = "float16"
    # Run a sequence's whole tiles in a loop without the logit and V masks, and mask only its last tiles.
    # None: on over fp8 caches, where it measured 1.05-1.07x faster, off over bf16 ones, where it measured
    # 0.98-0.99x (H200, B=64 ctx 4096 and B=256 ctx 2048, 2026-12-01).
    decode_mask_tail_only: bool | None = None
    # Decode kernel over an fp8 cache: "auto" (Mosaic GPU on Hopper when the shapes suit it, else Triton),
    # "mosaic" (``mosaic_decode``: TMA ring and wgmma; an error where it cannot run) or "triton". bf16 and
    # fp32 caches always take the Triton kernel. In interpret mode "auto" means Triton.
    decode_impl: str = "auto"
    # The Mosaic decode kernel's tiles in flight per CTA and tokens per tile: 2 x 128 measured fastest on the
    # H200 (fewer, larger tiles amortise each tile's fixed cost; a third stage halves the CTAs per SM).
    mosaic_decode_stages: int = 2
    mosaic_decode_block_kv: int = 128
    # Prefill kernel: "auto" (Mosaic GPU on Hopper when the shapes suit it, else Triton), "mosaic" (an error
    # where it cannot run) or "triton". In interpret mode "auto" means Triton.
    prefill_impl: str = "auto"
    mosaic_block_kv: int = 128  # KV tokens per Mosaic prefill pipeline step
    mosaic_stages: int = 2
    mosaic_pingpong: bool = False  # the two compute warpgroups take turns on the tensor cores
    mosaic_q_smem: bool = False  # Q as the wgmma A operand from shared memory instead of registers
    prefill_rows: int = 128  # Triton prefill: query rows (tokens x heads of a group) per program
    prefill_tile_tokens: int = 64
    prefill_warps: int = 4
    prefill_stages: int = 2
    # Zero V past each sequence's length: "where" (after the load), "load" (masked load) or "none"
    # (stale NaNs then propagate exactly as in the reference; finite stale values are harmless either way).
    v_mask: str = "where"
    # The KV write ahead of the kernels: "pallas" (``kv_write``: whole-row copies) or "xla" (the reference's
    # scatter, which measured 6x slower than a copy for prefill on the H200).
    kv_write: str = "pallas"
    # float32 products at HIGHEST precision run as IEEE FMAs on the CUDA cores, with no tensor-core
    # fragments to keep the tiles small: the bf16-sized tiles above then spill (sm_90 SASS of the prefill
    # kernel: 22 KB of stack a thread, 110k instructions, 52 s of ptxas for one kernel). True: such calls
    # take FP32_FMA_TILES for the tile fields left at their defaults.
    fp32_fma_tiles: bool = True


# Tiles of float32-IEEE products (fp32_fma_tiles), chosen from static sm_90 builds on the CPU (2026-12-02):
# the prefill kernel at 64 rows x 16 tokens, 8 warps: 312 B of stack, 3.7k instructions, 2.5 s of ptxas;
# the decode kernel at 32 tokens, 8 warps: no stack, 1.1k instructions (default tiles: 7.7 KB, 14k).
FP32_FMA_TILES = dict(prefill_rows=64, prefill_tile_tokens=16, prefill_warps=8, decode_tile_tokens=32, decode_warps=8)


def kernel_config_for(cfg: GpuKernelConfig, q_dtype, precision) -> GpuKernelConfig:
    """``cfg`` with FP32_FMA_TILES when the kernels' products are float32 FMAs (float32 q at HIGHEST), for
    the fields it leaves at their defaults: a tile the caller chose is kept."""
    fma = jnp.dtype(q_dtype) == jnp.float32 and prec.resolve(precision, q_dtype) == jax.lax.Precision.HIGHEST
    if not (cfg.fp32_fma_tiles and fma):
        return cfg
    default = GpuKernelConfig()
    return dataclasses.replace(
        cfg, **{k: v for k, v in FP32_FMA_TILES.items() if getattr(cfg, k) == getattr(default, k)}
    )


# Programs the decode grid aims for before it splits contexts: enough to keep the H200's 132 SMs
# streaming. 512, not 1024: at 64 sequences x 8 KV heads one split measured the same as two (within
# noise) and saves the merge kernel (2026-11-29).
_TARGET_DECODE_PROGRAMS = 512


def _decode_splits(num_seqs: int, num_kv_heads: int, tiles_per_seq: int) -> int:
    splits = tc.next_pow2(max(1, -(-_TARGET_DECODE_PROGRAMS // (num_seqs * num_kv_heads))))
    return max(1, min(splits, tiles_per_seq))


FP8_DECODE_COMPUTE = ("query", "float16")  # GpuKernelConfig.fp8_decode_compute's values


def _fp8_decode_compute(cfg: GpuKernelConfig, q_dtype, kv_dtype):
    if cfg.fp8_decode_compute not in FP8_DECODE_COMPUTE:
        raise ValueError(f"fp8_decode_compute={cfg.fp8_decode_compute!r}: use 'query' or 'float16'")
    if cfg.fp8_decode_compute == "float16" and fp8.is_fp8(kv_dtype) and q_dtype == jnp.bfloat16:
        return jnp.float16
    return None


def _use_mosaic_prefill(
    cfg: GpuKernelConfig, q, page_size: int, sliding_window, interpret: bool, kv_dtype=None
) -> bool:
    if cfg.prefill_impl not in ("auto", "mosaic", "triton"):
        raise ValueError(f"prefill_impl={cfg.prefill_impl!r}: use 'auto', 'mosaic' or 'triton'")
    if kv_dtype is not None and fp8.is_fp8(kv_dtype):
        # The Mosaic kernel's TMA/wgmma pipeline takes bf16/fp16 pages only: an fp8 cache prefills in Triton.
        if cfg.prefill_impl == "mosaic":
            raise ValueError("prefill_impl='mosaic' does not read an fp8 KV cache yet; use prefill_impl='auto' or 'triton'")
        return False
    if cfg.prefill_impl == "triton" or (cfg.prefill_impl == "auto" and interpret):
        return False
    reason = mosaic_prefill.unsupported_reason(
        head_dim=q.shape[-1], dtype=q.dtype, page_size=page_size, block_kv=cfg.mosaic_block_kv,
        stages=cfg.mosaic_stages, q_smem=cfg.mosaic_q_smem, sliding_window=sliding_window, interpret=interpret,
    )  # fmt: skip
    if reason is not None and cfg.prefill_impl == "mosaic":
        raise ValueError(f"prefill_impl='mosaic' cannot run here: {reason}; use prefill_impl='auto' or 'triton'")
    return reason is None


def _use_mosaic_decode(cfg: GpuKernelConfig, q, k_pages, v_token_minor: bool, rows: int, sliding_window, interpret) -> bool:
    if cfg.decode_impl not in ("auto", "mosaic", "triton"):
        raise ValueError(f"decode_impl={cfg.decode_impl!r}: use 'auto', 'mosaic' or 'triton'")
    if cfg.decode_impl == "triton" or not fp8.is_fp8(k_pages.dtype) or (cfg.decode_impl == "auto" and interpret):
        return False
    reason = "V pages token-minor (it reads token-major V)" if v_token_minor else mosaic_decode.unsupported_reason(
        head_dim=q.shape[-1], q_dtype=q.dtype, kv_dtype=k_pages.dtype, page_size=k_pages.shape[1], rows=rows,
        sliding_window=sliding_window, interpret=interpret, config=_mosaic_decode_config(cfg),
    )  # fmt: skip
    if reason is not None and cfg.decode_impl == "mosaic":
        raise ValueError(f"decode_impl='mosaic' cannot run here: {reason}; use decode_impl='auto' or 'triton'")
    return reason is None


def _mosaic_decode_config(cfg: GpuKernelConfig) -> mosaic_decode.MosaicDecodeConfig:
    return mosaic_decode.MosaicDecodeConfig(stages=cfg.mosaic_decode_stages, block_kv=cfg.mosaic_decode_block_kv)


def _mosaic_decode(q_p, k_pages, v_pages, md: AttentionMetadata, *, out=None, **kw):
    del out  # the Triton kernel's aliased buffer: this kernel returns its own rows
    return mosaic_decode.decode_attention_mosaic(
        q_p, k_pages, v_pages, md.query_start_loc, md.seq_lens, md.block_tables, md.token_seq_ids, **kw
    )


def paged_attention_pallas(
    q: jax.Array,  # [T, H, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D], or [N, K, D, P] when token-minor (fp8_v_token_minor)
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    precision: jax.lax.Precision | None = None,
    platform: str = "gpu",
    interpret: bool = False,
    config: GpuKernelConfig | None = None,
    k_scale=1.0,  # fp8 caches only (fp8.py)
    v_scale=1.0,
    # An fp8 cache's V pages are token-minor, [N, K, D, P] (kv_layout.py); None: kv_layout's switch.
    fp8_v_token_minor: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write this step's KV into its slots, then attend. Returns (out[T,H,D], k_pages, v_pages).

    Over an fp8 cache the kernels convert each K/V tile to q's dtype in registers; the scales are folded
    outside them, exactly (dequantization is linear): q·(k·ks) = (q·ks)·k, and sum p·(v·vs) = vs·sum p·v.

    ``precision`` goes to the Triton kernels' products (None: from q's dtype, float32 exact). The TPU op
    takes none, and the Mosaic prefill takes only bf16/fp16 (a float32 prefill runs in the Triton kernel).
    """
    is_fp8 = fp8.is_fp8(k_pages.dtype)
    if platform == "tpu":
        from jaxserve.pallas_kernels.tpu_ragged_adapter import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(
            q, k_new, v_new, k_pages, v_pages, md, scale=scale, sliding_window=sliding_window, interpret=interpret,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    cfg = config or GpuKernelConfig()
    v_minor = kv_layout.v_token_minor(v_pages.dtype, switch=fp8_v_token_minor)
    if cfg.kv_write not in ("pallas", "xla"):
        raise ValueError(f"kv_write={cfg.kv_write!r}: use 'pallas' or 'xla'")
    if cfg.kv_write == "pallas" and kv_write.supported(k_pages.shape[2], k_pages.shape[3]):
        k_pages, v_pages = kv_write.write_kv_pallas(
            k_pages, v_pages, k_new, v_new, md.slot_mapping, interpret=interpret, k_scale=k_scale, v_scale=v_scale,
            v_token_minor=v_minor,
        )  # fmt: skip
    else:
        k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, md.slot_mapping, k_scale, v_scale, v_minor)
    if is_fp8:
        q = fp8.fold_scale(q, k_scale)
    out = ragged_attention_gpu(
        q, k_pages, v_pages, md, scale=scale, sliding_window=sliding_window, precision=precision,
        interpret=interpret, config=config, v_token_minor=v_minor,
    )  # fmt: skip
    if is_fp8:
        out = fp8.fold_scale(out, v_scale)
    return out, k_pages, v_pages


def ragged_attention_gpu(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [N, P, K, D] (already holding this step's keys)
    v_pages: jax.Array,  # [N, P, K, D], or [N, K, D, P] with v_token_minor
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    precision: jax.lax.Precision | None = None,
    interpret: bool = False,
    config: GpuKernelConfig | None = None,
    v_token_minor: bool = False,  # v_pages is [N, K, D, P] (kv_layout.py)
) -> jax.Array:  # [T, H, D]
    """Attention only (no KV write), same semantics as ``ragged_paged_attention_reference``."""
    cfg = kernel_config_for(config or GpuKernelConfig(), q.dtype, precision)
    if interpret and cfg.v_mask == "load":
        # Pallas's interpreter cannot discharge a masked gather; "where" computes the same values.
        cfg = dataclasses.replace(cfg, v_mask="where")
    t, h, d = q.shape
    _, page_size, kh, _ = k_pages.shape
    s_count, width = md.block_tables.shape
    g = h // kh
    gp = tc.next_pow2(g)  # Triton tiles need power-of-two sizes
    q_per_seq = max(1, 16 // gp)  # decode rows = q_per_seq * gp >= 16, the smallest MMA tile
    if md.decode_only:  # a pure verify step: the decode kernel takes each sequence's 1 + k tokens
        q_per_seq = max(q_per_seq, tc.next_pow2(md.decode_query_len))
    block_q = max(1, cfg.prefill_rows // gp)
    use_mosaic = _use_mosaic_prefill(cfg, q, page_size, sliding_window, interpret, k_pages.dtype)
    if use_mosaic and v_token_minor:  # unreachable while only fp8 caches are token-minor (Mosaic takes no fp8)
        raise ValueError("the Mosaic prefill kernel reads token-major V only; use prefill_impl='triton'")
    # [T + pad, K, Gp, D]: the query heads of a KV head side by side. The Triton prefill kernel's tiles need
    # padding rows to stay in bounds, and so does the interpreter (it clamps the decode kernel's row window);
    # the decode kernel itself masks its loads and the Mosaic kernel reads q itself, so that path pads
    # nothing: a pad copies all of q (~90 µs for 8 x 2048 prefill tokens on the H200).
    if use_mosaic:
        pad = q_per_seq if interpret else 0
    else:
        pad = max(q_per_seq, block_q)
    q_p = jnp.pad(q.reshape(t, kh, g, d), ((0, pad), (0, 0), (0, gp - g), (0, 0)))
    qsl = md.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]  # [S]
    is_decode_seq = q_lens <= q_per_seq  # [S] (empty sequences fall here and do nothing)

    item = k_pages.dtype.itemsize  # pipelined tiles sit in shared memory in the cache's dtype (1 byte for fp8)
    dec_tile = tc.pick_tile_tokens(cfg.decode_tile_tokens, d, item, cfg.decode_stages)
    pre_tile = tc.pick_tile_tokens(cfg.prefill_tile_tokens, d, item, cfg.prefill_stages)
    splits = cfg.decode_splits or _decode_splits(s_count, kh, -(-width * page_size // dec_tile))
    compute_dtype = _fp8_decode_compute(cfg, q.dtype, k_pages.dtype)  # checks the option whichever kernel runs
    mosaic_dec = _use_mosaic_decode(cfg, q, k_pages, v_token_minor, q_per_seq * gp, sliding_window, interpret)
    if mosaic_dec:  # same contract as the Triton kernel's call, without the aliased output buffer
        decode = functools.partial(
            _mosaic_decode, q_p, k_pages, v_pages, md, scale=scale, q_per_seq=q_per_seq, interpret=interpret,
            config=_mosaic_decode_config(cfg),
        )  # fmt: skip
    else:
        decode = functools.partial(
            decode_attention, q_p, k_pages, v_pages, qsl, md.seq_lens, md.block_tables,
            scale=scale, q_per_seq=q_per_seq, tile_tokens=dec_tile, num_splits=splits,
            sliding_window=sliding_window, v_mask=cfg.v_mask, num_warps=cfg.decode_warps, num_stages=cfg.decode_stages,
            heads_inner=cfg.decode_heads_inner, precision=precision, interpret=interpret,
            compute_dtype=compute_dtype,
            mask_tail_only=fp8.is_fp8(k_pages.dtype) if cfg.decode_mask_tail_only is None else cfg.decode_mask_tail_only,
            v_token_minor=v_token_minor,
        )  # fmt: skip
    max_prefill_seqs = t // (q_per_seq + 1)  # a prefill sequence has more than q_per_seq tokens
    seq = md.token_seq_ids  # [T]
    r = jnp.arange(t, dtype=jnp.int32) - qsl[seq]  # [T] index of the token within its sequence's query
    in_range = (r >= 0) & (r < q_lens[seq])

    if md.decode_only:
        # Every sequence has one new token (the runner's pure-decode variant): the decode kernel alone.
        dec = decode()[:t, :, :g]
        return jnp.where(in_range[:, None, None, None], dec, 0).reshape(t, h, d)

    if use_mosaic:
        mcfg = mosaic_prefill.MosaicPrefillConfig(
            block_kv=cfg.mosaic_block_kv, stages=cfg.mosaic_stages, pingpong=cfg.mosaic_pingpong, q_smem=cfg.mosaic_q_smem,
        )
        pre = mosaic_prefill.prefill_attention_mosaic(
            q, k_pages, v_pages, qsl, md.seq_lens, md.block_tables, ~is_decode_seq,
            scale=scale, max_prefill_seqs=max_prefill_seqs, config=mcfg, interpret=interpret,
        )  # fmt: skip  [T, H, D]: prefill tokens' rows, zeros for padding tokens, decode rows unwritten
        if gp == g and not interpret and not mosaic_dec:
            # The decode kernel writes its rows into the same buffer: every row is then final, no routing
            # pass. (Interpret mode would clamp the decode kernel's row window at the buffer's end.)
            return decode(out=pre.reshape(t, kh, g, d)).reshape(t, h, d)
        pre = pre.reshape(t, kh, g, d)
    else:
        pre = prefill_attention(
            q_p, k_pages, v_pages, qsl, md.seq_lens, md.block_tables, ~is_decode_seq,
            num_tokens=t, max_prefill_seqs=max_prefill_seqs, scale=scale, block_q=block_q,
            tile_tokens=pre_tile, sliding_window=sliding_window, v_mask=cfg.v_mask,
            num_warps=cfg.prefill_warps, num_stages=cfg.prefill_stages, precision=precision, interpret=interpret,
            v_token_minor=v_token_minor,
        )[:t, :, :g]  # fmt: skip  rows of prefill tokens
    dec = decode()[:t, :, :g]  # rows of decode tokens

    # Each token takes the output of the kernel that owned its sequence; tokens outside every query
    # range (padding) get zeros instead of whatever the unwritten rows held.
    use_dec = (in_range & is_decode_seq[seq])[:, None, None, None]
    use_pre = (in_range & ~is_decode_seq[seq])[:, None, None, None]
    out = jnp.where(use_dec, dec, jnp.where(use_pre, pre, 0))
    return out.reshape(t, h, d)
