"""The fp8 attention bench's variant options: what each row runs, parsed without running a kernel."""

from __future__ import annotations

import pytest

from jaxserve.bench import attention_fp8 as bench


def test_variant_parsing_and_rows_cover_every_format_and_compute():
    name, over = bench._parse_variant("tail=decode_mask_tail_only=true,decode_tile_tokens=32")
    assert (name, over) == ("tail", {"decode_mask_tail_only": True, "decode_tile_tokens": 32})
    variants = [(name, over)]
    bf16 = list(bench._configs("auto", ["float16", "query"], variants))
    assert [(v, c) for v, c, *_ in bf16] == [("default", "-"), ("tail", "-")]  # fp8 modes mean nothing for bf16
    fp8_rows = list(bench._configs("fp8_e4m3", ["float16", "query"], variants))
    assert [(v, c) for v, c, *_ in fp8_rows] == [
        ("default", "float16"), ("default", "query"), ("tail", "float16"), ("tail", "query"),
    ]  # fmt: skip
    cfg = fp8_rows[-1][2]
    assert cfg.fp8_decode_compute == "query" and cfg.decode_mask_tail_only and cfg.decode_tile_tokens == 32
    assert not any(v_minor for *_, v_minor in fp8_rows)


def test_token_minor_v_variant_applies_to_fp8_rows_only():
    variants = [bench._parse_variant("tm=fp8_v_token_minor=true")]
    assert variants == [("tm", {"fp8_v_token_minor": True})]
    assert [m for *_, m in bench._configs("auto", ["float16"], variants)] == [False, False]
    assert [m for *_, m in bench._configs("fp8_e5m2", ["float16"], variants)] == [False, True]


def test_unknown_field_or_compute_names_the_choices():
    with pytest.raises(SystemExit, match="GpuKernelConfig field"):
        bench._parse_variant("x=decode_tiles=32")
    with pytest.raises(SystemExit, match="query"):
        bench.main(["--fp8-decode-compute", "float8", "--quick"])
