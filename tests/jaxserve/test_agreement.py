"""`jaxserve agreement`: records of one model line up position by position, and the comparison finds what it
should. A float32 jaxserve record of a tiny checkpoint agrees with HF's record of it to rounding (identical greedy
tokens); the comparison's arithmetic (teacher-forced positions, divergence margins, rounding tolerance) is checked
on hand-made records; bad input gets errors that say what to pass."""

from __future__ import annotations

import copy
import json

import pytest
from engine_fixtures import checkpoint, run_cache_dir

from jaxserve.agreement import compare
from jaxserve.cli import main


def _pos(token: int, top: list[tuple[int, float]]) -> dict:
    lp = dict(top)
    return {"token": token, "logprob": lp[token], "top": [list(t) for t in top]}


def _record(greedy: list[dict]) -> dict:
    return {"format": "jaxserve-agreement/1", "prompts": [{
        "prompt_token_ids": [0, 5, 6],
        "prompt_positions": [_pos(5, [(5, -0.5), (7, -1.5)]), _pos(6, [(8, -0.2), (6, -2.0)])],
        "greedy_token_ids": [p["token"] for p in greedy], "greedy_positions": greedy}],
        "token_text": {"3": " a", "4": " b|c", "9": " z"}}  # fmt: skip


def test_compare_counts_forced_positions_and_explains_a_near_tie():
    ref = _record([_pos(3, [(3, -0.70), (4, -0.72)]), _pos(9, [(9, -0.1), (3, -3.0)])])
    other = copy.deepcopy(ref)
    other["prompts"][0]["prompt_positions"][0]["logprob"] = -0.48  # |d| = 0.02 on a prompt position
    other["prompts"][0]["greedy_positions"][0] = _pos(4, [(4, -0.705), (3, -0.71)])  # a flipped near tie
    result = compare.compare(ref, other, "a", "b")
    assert result["positions"] == {"prompt": 2, "generated": 1}  # nothing after the divergence is compared
    assert result["logprob_diff"]["max"] == pytest.approx(0.02)
    assert result["top1_agreement"] == pytest.approx(2 / 3)
    assert result["greedy"] == {"prompts": 1, "identical": 0, "tokens_matched": 0, "tokens": 2}
    (d,) = result["divergences"]
    assert (d["ref_token"], d["other_token"]) == (3, 4)
    assert d["ref_margin"] == pytest.approx(0.02) and d["other_margin"] == pytest.approx(0.005)
    assert result["tolerance"] == pytest.approx(0.04)
    assert d["explained"] and result["unexplained"] == 0  # margins 0.025 <= 2 x 0.02


def test_compare_flags_a_divergence_rounding_cannot_explain():
    ref = _record([_pos(3, [(3, -0.1), (4, -5.0)]), _pos(9, [(9, -0.1), (3, -3.0)])])
    other = copy.deepcopy(ref)
    other["prompts"][0]["greedy_positions"][1] = _pos(3, [(3, -0.1), (9, -4.0)])  # 2.9 and 3.9 nats: no tie
    result = compare.compare(ref, other, "a", "b")
    assert result["greedy"]["tokens_matched"] == 1 and result["unexplained"] == 1
    report = compare.markdown({"a": ref, "b": other}, [result])
    assert "| 0 | 1 | 9 ' z' | 3 ' a' | 2.9 | 3.9 | **no** |" in report
    assert "' b\\|c'" not in report  # token 4 never shown; a '|' in a shown token would be escaped


def test_compare_margin_outside_top_k_is_a_bound():
    ref = _record([_pos(3, [(3, -0.1), (4, -2.0)])])
    other = copy.deepcopy(ref)
    other["prompts"][0]["greedy_positions"][0] = _pos(9, [(9, -0.1), (4, -2.5)])  # ref's 3 not in its top 2
    (d,) = compare.compare(ref, other)["divergences"]
    assert d["ref_margin_exact"] is False and not d["explained"]
    assert d["other_margin"] == pytest.approx(2.4)  # down to its last listed token


def test_compare_refuses_records_of_different_tokenizers():
    ref = _record([_pos(3, [(3, -0.1)])])
    other = copy.deepcopy(ref)
    other["prompts"][0]["prompt_token_ids"] = [0, 5, 7]
    with pytest.raises(ValueError, match="prompt 0 has different tokens in a and b"):
        compare.compare(ref, other, "a", "b")


def test_compare_cli_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "notes.json"
    bad.write_text(json.dumps({"hello": 1}))
    good = tmp_path / "r.json"
    good.write_text(json.dumps(_record([_pos(3, [(3, -0.1)])])))
    assert main(["agreement", "compare", str(good), str(bad)]) == 2
    assert "notes.json' is not an agreement record" in capsys.readouterr().err
    assert main(["agreement", "compare", str(good)]) == 2
    assert "at least two records" in capsys.readouterr().err


def test_record_errors_before_loading(tmp_path, capsys):
    assert main(["agreement", "record", str(tmp_path / "x.json"), "--k", "0"]) == 2
    assert "--k must be in [1, 20], got 0" in capsys.readouterr().err
    assert main(["agreement", "record", str(tmp_path / "x.json"), "--model", "/nonexistent", "--skip-tokenizer-init"]) == 2
    assert "needs the model's tokenizer" in capsys.readouterr().err  # said before the (missing) model is looked for


def test_float32_record_agrees_with_hf_record(tmp_path, capsys):
    model = checkpoint("llama_gqa")
    common = ["--model", model, "--dtype", "float32", "--max-tokens", "4", "--k", "3", "--num-prompts", "3",
              "--max-model-len", "512"]
    ours, hf = tmp_path / "jaxserve_cpu.json", tmp_path / "hf_cpu.json"
    assert main(["agreement", "record", str(ours), *common, "--compilation-cache-dir", run_cache_dir(), "--precompile", "none"]) == 0
    assert main(["agreement", "record", str(hf), *common, "--hf"]) == 0
    capsys.readouterr()
    out_json = tmp_path / "cmp.json"
    assert main(["agreement", "compare", str(hf), str(ours), "--output", str(tmp_path / "r.md"),
                 "--output-json", str(out_json)]) == 0  # fmt: skip
    report = capsys.readouterr().out
    assert report == (tmp_path / "r.md").read_text()
    assert "| jaxserve_cpu | cpu | cpu | float32 | highest | xla | 1 | 1 | none | jax " in report
    (result,) = json.loads(out_json.read_text())
    assert result["greedy"]["identical"] == result["greedy"]["prompts"] == 3
    assert result["top1_agreement"] == 1.0 and result["logprob_diff"]["max"] < 1e-4
    rec = json.loads(ours.read_text())
    first = rec["prompts"][0]
    assert len(first["greedy_positions"]) == 4 and len(first["prompt_positions"]) == len(first["prompt_token_ids"]) - 1
    assert all(len(p["top"]) == 3 for p in first["greedy_positions"])
    assert first["greedy_positions"][0]["top"][0][0] == first["greedy_token_ids"][0]  # greedy takes the top token
