"""speculative_config parsing and errors, the CLI flag, the n-gram proposer, and the metrics' names."""

import numpy as np
import pytest

from jaxserve.cli import build_parser, engine_args_from, parse_args
from jaxserve.config import EngineArgs
from jaxserve.llm_engine import EngineStats
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramProposer
from jaxserve.spec_decode.stats import SpecDecodeStats


def test_parse_dict_and_json():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 1, 5)
    c = SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 2}')
    assert (c.method, c.model) == ("draft_model", "/m")
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, r"method='medusa' is not supported.*'ngram', 'draft_model'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method=.eagle. needs .model.: the directory of an EAGLE head"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, r"method=.eagle3. needs .model."),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens=0 is invalid: give an integer >= 1"),
    ({"method": "ngram"}, r"num_speculative_tokens=None is invalid"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min=4 > prompt_lookup_max=2"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, r"unknown keys \['lookahead'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "forced_acceptance_length": 3}, r"forced_acceptance_length=3"),
    ("{not json", r"not valid JSON"),
])  # fmt: skip
def test_errors_name_the_key_the_value_and_what_works(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value).validate()


def test_cli_flag():
    parser = build_parser()
    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    ns = parse_args(parser, ["generate", "hi", "--speculative-config", flag])
    args = engine_args_from(ns)
    assert SpeculativeConfig.parse(args.speculative_config).num_speculative_tokens == 3


def test_ngram_proposer():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 9, 9, 2, 3], 3) == [4, 9, 9]  # "2 3" seen before, followed by 4 9 9
    assert p.propose([1, 2, 3, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the most recent earlier copy of "1 2 3"
    assert p.propose([5, 6, 7, 8], 3) == []
    assert p.propose([5, 6, 5], 3) == [6, 5]  # what follows is shorter than k near the end
    assert NgramProposer(2, 2).propose([1, 2, 3, 2], 2) == []  # "3 2" never seen; a 1-gram is not tried


def _reference_propose(token_ids, k, lo, hi):
    """The proposer's first version (a sliding-window search per n), kept as the reference of its rule."""
    tokens = np.asarray(token_ids, np.int64)
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 4), (1, 1), (3, 3)])
def test_ngram_proposer_matches_the_reference(lo, hi):
    """The one-pass search gives the sliding-window search's proposals, with and without a growing buffer (a
    sequence extended a few tokens at a time, sometimes truncated as a stop string does; finished ones retained away)."""
    rng = np.random.default_rng(lo * 10 + hi)
    p = NgramProposer(lo, hi)
    for trial in range(30):
        vocab = int(rng.integers(2, 8))  # small vocabularies: many partial matches
        seq = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        key = object()
        for _ in range(25):
            k = int(rng.integers(1, 5))
            want = _reference_propose(seq, k, lo, hi)
            assert p.propose(seq, k) == want, (seq, k)
            assert p.propose(seq, k, key=key) == want, (seq, k)
            if rng.random() < 0.1:  # truncated (a stop string, Request.truncate_output): the buffer starts over
                del seq[int(rng.integers(1, len(seq))) if len(seq) > 1 else 1 :]
            else:  # a request's tokens otherwise only grow, by one step's tokens
                seq += rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
        p.retain([key])
        assert len(p._buffers) == 1
    p.retain([])
    assert not p._buffers


def test_metrics_names_and_rates():
    s = SpecDecodeStats(3)
    s.record(3, 2)
    s.record(3, 0)
    s.record(2, 2)
    assert s.summary()["acceptance_rate"] == round(4 / 8, 4) and s.mean_acceptance_length == 1 + 4 / 3
    assert s.accepted_per_pos == [2, 2, 0]
    from jaxserve.server.metrics import _spec_decode_metrics

    stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, **s.engine_stats())
    families = {f.name: f for f in _spec_decode_metrics(stats, "m")}
    assert set(families) == {"jaxserve:spec_decode_num_drafts", "jaxserve:spec_decode_num_draft_tokens",
                             "jaxserve:spec_decode_num_accepted_tokens",
                             "jaxserve:spec_decode_num_accepted_tokens_per_pos"}
    per_pos = families["jaxserve:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [(x.labels["position"], x.value) for x in per_pos] == [("0", 2.0), ("1", 2.0), ("2", 0.0)]


def test_bench_spec_decode_parses_and_describes():
    from jaxserve.bench.spec_decode import describe

    ns = parse_args(build_parser(), ["bench", "spec-decode", "--speculative-config", '{"method": "ngram", '
                                     '"num_speculative_tokens": 3}', "--output-len", "50"])
    assert ns.output_len == 50 and SpeculativeConfig.parse(ns.speculative_config).method == "ngram"
    res = {"spec_tokens_per_s": 60.0, "plain_tokens_per_s": 35.0, "speedup": 60 / 35, "identical_tokens": True,
           "spec_decode": {"acceptance_rate": 0.6, "mean_acceptance_length": 2.9, "acceptance_rate_per_pos": [0.7]},
           "loop_ms_per_step": {"spec": {"host": 5.0, "propose": 2.0, "wait": 37.0, "steps": 3}}}
    assert "1.71x" in describe(res) and "mean acceptance length 2.90" in describe(res)
    assert "5.00 ms host (of which 2.00 proposing)" in describe(res)
