"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one step.

One job per module:
- ``config``: ``SpeculativeConfig`` (vLLM's ``speculative_config`` keys), parsed and validated once.
- ``ngram``: prompt-lookup proposals on the host.
- ``draft_model``: proposals from a smaller model with its own KV cache, sharing the target's block tables.
- ``draft_program``: a round (catch-up + k - 1 greedy decode steps) as one jitted program.
- ``eagle`` / ``eagle_loader``: EAGLE-1 / EAGLE-3 heads over the target's stored hidden states.
- ``fed_rounds``: the next round dispatched right behind the verify step, fed by its tokens on the device.
- ``rejection``: the pure on-device acceptance rule (greedy prefix match; rejection sampling).
- ``verify``: the jitted verify step (proposals are extra query tokens of a sequence in the ragged batch).
- ``stats``: the counters behind vLLM's spec-decode metrics.
"""
