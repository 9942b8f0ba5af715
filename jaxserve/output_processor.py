"""Turns the scheduler's per-step token updates into RequestOutputs: detokenization, stop strings,
logprobs, and the grouping of n > 1 samples under one request id."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Optional

from jaxserve.detokenizer import IncrementalDetokenizer, decode_token
from jaxserve import prompt_logprobs
from jaxserve.outputs import CompletionOutput, Logprob, LogprobsDict, RequestOutput
from jaxserve.request import Request
from jaxserve.scheduler_output import ModelRunnerOutput


@dataclasses.dataclass
class SampleState:
    """Host-side state of one sample (one child Request)."""

    request: Request
    index: int
    detokenizer: Optional[IncrementalDetokenizer]
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    stop_reason: Optional[int | str] = None
    finish_reason: Optional[str] = None
    num_processed: int = 0  # output tokens already detokenized and given logprobs
    # Detokenize only once the request ends: nobody sees its text before (a final_only request alone in its group)
    # and nothing in it can end it early (no stop strings) or needs the step's rows (no logprobs). The text is the
    # same: the same tokens go through the same incremental detokenizer, later.
    deferred: bool = False

    def completion(self) -> CompletionOutput:
        # Positional, in field order: streaming builds one per request per step, and keywords cost twice as much.
        return CompletionOutput(
            self.index,
            self.detokenizer.output_text if self.detokenizer else "",  # text
            list(self.request.output_token_ids),  # token_ids: a snapshot, the request's list grows on
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )


@dataclasses.dataclass
class RequestGroup:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[SampleState]
    arrival_time: float
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    prompt_logprobs: Optional[list] = None  # RequestOutput.prompt_logprobs, once complete
    # Only the finished output is wanted (output_kind="final_only", as LLM.generate asks): kept as a field, since
    # it is asked of every request every step.
    final_only: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.final_only = self.samples[0].request.sampling_params.output_kind == "final_only"

    @property
    def finished(self) -> bool:
        samples = self.samples
        if len(samples) == 1:  # n == 1, asked of every request every step
            return samples[0].finish_reason is not None
        return all(s.finish_reason is not None for s in samples)

    def output(self) -> RequestOutput:
        # Positional, in field order (as SampleState.completion).
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [s.completion() for s in self.samples],  # outputs
            self.finished,
            self.samples[0].request.num_cached_tokens,
            {  # metrics
                "arrival_time": self.arrival_time,
                "first_token_time": self.first_token_time,
                "finish_time": self.finish_time,
            },
            self.prompt_logprobs,
        )


class OutputProcessor:
    """Keeps the groups and samples; processes one step's updated requests."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.samples: dict[str, tuple[RequestGroup, SampleState]] = {}  # child request id -> state
        self.deferred_text: dict[str, SampleState] = {}  # the deferred samples with a detokenizer, by child id
        self._token_text: dict[int, str] = {}  # token id -> decode_token's text (at most the vocabulary)

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for s in group.samples:
            self.samples[s.request.request_id] = (group, s)
            s.deferred = (
                group.final_only
                and len(group.samples) == 1
                and s.request.sampling_params.logprobs is None
                and (s.detokenizer is None or not s.detokenizer.has_stops)
            )
            if s.deferred and s.detokenizer is not None:
                self.deferred_text[s.request.request_id] = s

    def child_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [s.request.request_id for s in group.samples] if group else []

    def process(
        self, updated: list[Request], rows: dict[str, int], runner_out: Optional[ModelRunnerOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs of the groups touched, child ids a stop string finished: the scheduler must free them)."""
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        stopped_by_string: list[str] = []
        samples = self.samples
        stride = runner_out.logprobs_stride if runner_out is not None else 1
        # Without logprobs in the step (the common case) no row has any to add: skip the per-token lookups.
        with_logprobs = runner_out is not None and runner_out.sampled_logprobs is not None and bool(rows)
        for req in updated:
            entry = samples.get(req.request_id)
            if entry is None:
                continue
            group, state = entry
            if group.first_token_time is None and req.output_token_ids:
                group.first_token_time = now
            if state.deferred and not req.status.finished:
                continue  # nothing to do until it finishes (SampleState.deferred)
            # One new token a step, or several with speculative decoding: each is processed as if alone.
            new_tokens = req.output_token_ids[state.num_processed :]
            detokenizer = state.detokenizer
            for j, token in enumerate(new_tokens):
                state.num_processed += 1
                if with_logprobs and req.request_id in rows:
                    self._add_logprobs(state, token, rows[req.request_id] * stride + j, runner_out)
                if detokenizer is not None:
                    detokenizer.update_one(token)
                    # A stop string before the step's last token wins over a stop the scheduler saw later.
                    if detokenizer.stop_string is not None and (not req.status.finished or j + 1 < len(new_tokens)):
                        stopped_by_string.append(req.request_id)
                        state.finish_reason = "stop"
                        state.stop_reason = state.detokenizer.stop_string
                        req.truncate_output(state.num_processed)  # what the step emitted past the stop
                        break
            if req.status.finished and state.finish_reason is None:
                state.finish_reason = req.status.finish_reason
                state.stop_reason = req.stop_reason
                if state.detokenizer is not None:
                    state.detokenizer.finish()
            if state.finish_reason is None and group.final_only and len(group.samples) == 1:
                continue  # no output until it finishes (n > 1 groups stay listed: they keep their place in the order)
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            if group.samples[0].request.prompt_logprobs is not None:
                self._prompt_logprobs(group)
            finished = group.finished
            if finished:
                group.finish_time = now
                outputs.append(group.output())
                self._drop(group)
            elif not group.final_only:
                outputs.append(group.output())
        return outputs, stopped_by_string

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        group = self.groups.get(request_id)
        if group is None:
            return None
        for s in group.samples:
            if s.deferred:  # the text so far, as the output of every step would have had it
                self._catch_up(s)
            if s.finish_reason is None:
                s.finish_reason = "abort"
        group.finish_time = time.monotonic()
        if group.samples[0].request.prompt_logprobs is not None:
            self._prompt_logprobs(group)
        self._drop(group)
        return group.output()

    def catch_up_deferred(self, busy: Callable[[], bool], every: int = 16) -> None:
        """Detokenize the deferred samples' tokens so far, for as long as ``busy()`` holds (asked every ``every``
        samples). The engine calls this while the device computes the step it is about to read. Otherwise a
        deferred sample decodes all of its tokens in the step where it finishes. In an offline batch that is
        the run's last steps, where the device would wait for the host (BENCHMARKS §29). The text is the
        same: the same tokens go through the same detokenizer, only sooner."""
        for i, state in enumerate(self.deferred_text.values()):
            if i % every == 0 and not busy():
                return
            if state.num_processed < len(state.request.output_token_ids):
                self._catch_up(state)

    @staticmethod
    def _catch_up(state: SampleState) -> None:
        """Detokenize a deferred sample's tokens not processed yet (it has no stop strings or logprobs)."""
        new_tokens = state.request.output_token_ids[state.num_processed :]
        state.num_processed += len(new_tokens)
        if state.detokenizer is not None:
            for token in new_tokens:
                state.detokenizer.update_one(token)

    def _drop(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for s in group.samples:
            self.samples.pop(s.request.request_id, None)
            self.deferred_text.pop(s.request.request_id, None)

    def _add_logprobs(self, state: SampleState, token: int, row: int, out: ModelRunnerOutput) -> None:
        k = state.request.sampling_params.logprobs
        if k is None or out.sampled_logprobs is None:
            return
        lp = float(out.sampled_logprobs[row])
        entry = self._entry(token, lp, out.sampled_ranks[row], out.top_token_ids[row][:k], out.top_logprobs[row][:k],
                            state.request.sampling_params.detokenize)
        if state.logprobs is None:
            state.logprobs = []
        state.logprobs.append(entry)
        state.cumulative_logprob = (state.cumulative_logprob or 0.0) + lp

    def _entry(self, token: int, lp: float, rank: int, top_ids: list, top_lps: list, decode: bool = True
               ) -> LogprobsDict:  # fmt: skip
        """One position's dict: ``token`` (its logprob and rank) first, then the top alternatives (Python lists,
        already cut to the request's k) ranked by their place in that list; ``decode``: with each token's text
        (decoded_token). Prompt logprobs call this once per prompt token, so it stays lean."""
        text = self._decode if decode else _no_text
        entry = {token: Logprob(lp, rank, text(token))}
        for place, (tid, tlp) in enumerate(zip(top_ids, top_lps), start=1):
            if tid != token:
                entry[tid] = Logprob(tlp, place, text(tid))
        return entry

    def _prompt_logprobs(self, group: RequestGroup) -> None:
        """Build the group's prompt logprobs once its first sample has them all (prompt_logprobs.py)."""
        request = group.samples[0].request
        if group.prompt_logprobs is None and prompt_logprobs.complete(request):
            entry = functools.partial(self._entry, decode=request.sampling_params.detokenize)
            group.prompt_logprobs = prompt_logprobs.as_list(group.prompt_token_ids, request.prompt_logprobs, entry)

    def _decode(self, token: int) -> Optional[str]:
        """A token's own text, decoded once per id (prompt logprobs decode k + 1 tokens per prompt position)."""
        text = self._token_text.get(token)
        if text is None and self.tokenizer is not None:
            text = self._token_text[token] = decode_token(self.tokenizer, token)
        return text


def _no_text(token: int) -> None:
    return None  # detokenize=False: logprobs without each token's text
