"""Continuous-batching scheduler: which requests run each step, and how many tokens each computes.

One rule for every request (see the design guide): a scheduled request computes
``min(num_tokens - num_computed_tokens, remaining budget)`` tokens. A fresh prompt, a chunk of a long
prompt, a decode step, a prompt partly served by the prefix cache, and a preempted request catching up
are all this one rule; there is no separate prefill phase. Each step takes the running requests first,
in admission order, then admits waiting ones first come first served while the token budget,
``max_num_seqs`` and free KV blocks last.

Under KV pressure the scheduler preempts by recompute: the most recently admitted running request
gives its blocks back and goes to the front of the queue, to recompute prompt + generated tokens later
(often mostly from the prefix cache) and carry on exactly where it stopped.

Asynchronous scheduling: ``schedule`` may run again before the last step's results are back. A
request whose step N samples a token gets a *pending* token; step N+1 can still compute it (the runner
feeds the sampled id from the device), so the scheduler counts it as known work and advances
``num_computed_tokens`` when it schedules, not when results arrive. ``update_from_output`` for step N
then appends the tokens and applies stop checks one step late; a request that stopped at step N has its
row of step N+1 ignored, so a token computed past a stop is never emitted. ``max_tokens`` and
``max_model_len`` are known ahead, so a request whose pending token reaches them is not scheduled again.

Pure Python, no arrays. Not thread safe: ``schedule`` and ``update_from_output`` run on the engine
thread, at most one step ahead of the results, and aborts must be delivered there too.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable, Optional

from jaxserve.block_manager import KVCacheManager
from jaxserve.request import Request, RequestStatus
from jaxserve.scheduler_output import ModelRunnerOutput, ScheduledSeq, SchedulerOutput


class Scheduler:
    """Decides each step's batch and applies its results (new tokens, stop checks, freeing blocks)."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        max_loras: int = 0,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError(
                f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens} and "
                f"max_model_len={max_model_len} must all be >= 1"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} < max_model_len={max_model_len} without "
                "chunked prefill: a long prompt could never be scheduled. Raise --max-num-batched-tokens, "
                "lower --max-model-len, or enable chunked prefill."
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # Only chunked prefill may split a prompt, so the cap means nothing without it.
        self.long_prefill_token_threshold = long_prefill_token_threshold if enable_chunked_prefill else 0
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        # A request alone in the cache must always fit, or preempting everyone else would not help it:
        # so a request ends with "length" once it fills the cache, even if max_model_len is larger.
        self.max_len = min(max_model_len, self.kv.max_num_tokens)
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self._num_host_token_requests = 0  # of those, the ones with SamplingParams.needs_host_tokens (usually none)
        self.waiting: collections.deque[Request] = collections.deque()  # FIFO; preempted go in front
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0  # total, for metrics
        # With LoRA: at most this many distinct adapters in one step (the device has that many slots), and only
        # adapters whose weights have been read (``lora_ready(lora_request)``, set by the engine; None: all are).
        self.max_loras = max_loras
        self.lora_ready: Optional[Callable] = None

    # ---- queries ----

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache (each admission's whole sequence)."""
        return self.kv.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens served from the prefix cache."""
        return self.kv.prefix_cache_hits

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError if its prompt could never be scheduled (the engine
        should have rejected it with a better message already)."""
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if n > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {n} tokens is longer than "
                f"max_model_len={self.max_model_len}"
            )
        if n > self.kv.max_num_tokens:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {n} tokens does not fit in the KV cache "
                f"({self.kv.num_usable_blocks} blocks x {self.kv.block_size} = {self.kv.max_num_tokens} "
                "tokens). Give the cache more memory (--gpu-memory-utilization, --num-gpu-blocks-override) "
                "or lower --max-model-len."
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._num_host_token_requests += request.sampling_params.needs_host_tokens
        self.waiting.append(request)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (client abort, stop string found by the detokenizer) and
        free their blocks at once. Unknown or already finished ids are ignored. If one of them is in the
        step now running, ``update_from_output`` skips its row."""
        assert status.finished, status
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            request = self.requests.pop(req_id, None)
            if request is None:
                continue
            self._num_host_token_requests -= request.sampling_params.needs_host_tokens
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            request.num_pending_tokens = 0  # whatever is in flight for it is dropped
            self.kv.free(request)

    # ---- the step ----

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks (preempting if needed)."""
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        scheduled: list[Request] = []  # parallel to seqs
        preempted: list[str] = []

        loras: set[int] = set()  # adapters of this step's requests (the base model's 0 need not be kept)

        # Running requests first, in admission order; a victim is always taken from the unscheduled end.
        # This loop runs for every running request every step: the checks that rarely apply (a pending token, an
        # adapter, proposals) are only called when their attribute says they can.
        running = self.running  # preemption pops from this same list
        threshold = self.long_prefill_token_threshold
        allocate_slots = self.kv.allocate_slots
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = len(request.all_token_ids) + request.num_pending_tokens - request.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if (
                num_new <= 0
                or (request.num_pending_tokens and self._reaches_limit(request))
                or (request.lora_request is not None and not self._lora_fits(request, loras))
            ):
                i += 1  # its pending token ends it (or nothing to do until results are back)
                continue
            spec = self._spec_tokens(request, num_new, budget) if request.spec_token_ids else ()
            if spec and not allocate_slots(request, num_new + len(spec)):
                spec = ()  # no room for the proposals: an ordinary decode, which may preempt as usual
            while not allocate_slots(request, num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                seqs.append(self._scheduled_seq(request, num_new, row=len(seqs), spec=spec))
                scheduled.append(request)
                budget -= num_new + len(spec)
                if request.lora_request is not None:
                    loras.add(request.lora_request.lora_int_id)
                i += 1

        # Then waiting ones, FIFO. Not after a preemption: the cache is full, and admitting now would
        # only preempt again next step.
        # A request whose adapter would exceed max_loras is passed over (it keeps its place for a later step).
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[j]
            if not self._lora_fits(request, loras):
                j += 1
                continue
            if request.num_pending_tokens:
                break  # preempted with a token in flight: admit it once that token is known (next step)
            # Prompt logprobs need every prompt token computed: no prefix-cache hits for them (prompt_logprobs.py).
            computed_blocks, num_cached = (
                ([], 0) if request.needs_prompt_logprobs else self.kv.get_computed_blocks(request)
            )  # fmt: skip
            remaining = request.num_tokens - num_cached
            if not self.enable_chunked_prefill and remaining > budget:
                break  # waits for a step with room for the whole prompt; FIFO, so nobody overtakes it
            num_new = self._num_new_tokens(request, num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, computed_blocks):
                break
            del self.waiting[j]
            if request.lora_int_id:
                loras.add(request.lora_int_id)
            if request.status == RequestStatus.WAITING:  # first admission, not a preempted one's return
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seqs.append(self._scheduled_seq(request, num_new, row=len(seqs)))
            scheduled.append(request)
            budget -= num_new

        return SchedulerOutput(
            seqs=seqs,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted_req_ids=preempted,
            requests=scheduled,
        )

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results (possibly a step after later ones were scheduled). Returns the
        requests that got a new token or finished, in the order they were scheduled; finished ones have
        already released their blocks. Rows of requests that finished meanwhile (a stop seen in the
        previous step's results, an abort) are ignored: their tokens were computed past the end."""
        updated: list[Request] = []
        any_finished = False
        emitted = runner_out.emitted_token_ids
        sampled = runner_out.sampled_token_ids
        cache_full_blocks = self.kv.cache_full_blocks
        for row, (seq, request) in enumerate(zip(sched_out.seqs, sched_out.requests)):
            if request.status.finished:
                continue
            if seq.sample:
                request.num_pending_tokens -= 1
                if emitted is None:  # one token a row: the common case, without the loop
                    num_emitted = 1
                    token = sampled[row]
                    request.output_token_ids.append(token)  # append_output_token, inline: every request every step
                    request.all_token_ids.append(token)
                    self._check_stop(request)
                else:
                    tokens = emitted[row]
                    num_emitted = len(tokens)
                    for token in tokens:  # with speculation the accepted proposals and one more
                        request.append_output_token(token)
                        self._check_stop(request)
                        if request.status.finished:
                            break  # tokens past a stop or a length limit are dropped
                if seq.num_spec_tokens:
                    # Roll back the rejected proposals: their KV is not the sequence's, and their slots go back.
                    request.num_computed_tokens -= seq.num_spec_tokens - (num_emitted - 1)
                    self.kv.free_tail(request, request.num_computed_tokens + 1)
                updated.append(request)
            status = request.status
            # Before freeing: a finished request's blocks stay revivable for a follow-up turn.
            if status is RequestStatus.RUNNING or status.finished:
                cache_full_blocks(request)
            if status.finished:
                any_finished = True
                request.num_pending_tokens = 0  # a token the next step computed past the end is dropped
                del self.requests[request.request_id]
                self._num_host_token_requests -= request.sampling_params.needs_host_tokens
                self.kv.free(request)
                if request in self.waiting:  # preempted while its last token was in flight
                    self.waiting.remove(request)
        if any_finished:
            self.running = [r for r in self.running if not r.status.finished]
        return updated

    def has_pending_host_token_rows(self, grammar: bool = True) -> bool:
        """Whether a running request with a token in flight needs its tokens on the host before the next step is
        scheduled (penalties; a grammar too unless ``grammar=False``, when the runner can hold the sampler back
        until the grammar has taken the token), so the engine reads the step in flight back first."""
        if not self._num_host_token_requests:
            return False
        return any(
            r.num_pending_tokens and (r.sampling_params.uses_penalties or (grammar and r.grammar is not None))
            for r in self.running
        )

    # ---- helpers ----

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """Whether the request's adapter (if any) can join this step's adapters within max_loras."""
        lora_id = request.lora_int_id
        if not lora_id or lora_id in loras:
            return True
        return len(loras - {0}) < self.max_loras and (self.lora_ready is None or self.lora_ready(request.lora_request))

    def _reaches_limit(self, request: Request) -> bool:
        """A pending token will end this request by length: scheduling it again would compute past the end."""
        pending = request.num_pending_tokens
        if not pending:
            return False
        max_tokens = request.sampling_params.max_tokens  # asked of every request every async step: lengths, no properties
        return len(request.all_token_ids) + pending >= self.max_len or (
            max_tokens is not None and len(request.output_token_ids) + pending >= max_tokens
        )

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens_with_pending - num_computed
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, budget)

    def _spec_tokens(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposals this decode step verifies: the request's, cut to what the budget, max_model_len and
        max_tokens leave (each step emits at most len(proposals) + 1 tokens). Only a plain decode with nothing in
        flight verifies proposals: a prefill chunk or a token still pending takes none."""
        spec = request.spec_token_ids
        caught_up = request.num_computed_tokens == request.num_tokens - 1
        decoding = num_new == 1 and not request.num_pending_tokens and caught_up
        if not spec or not decoding:
            return []
        room = min(budget - 1, self.max_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return spec[: max(room, 0)]

    def _scheduled_seq(self, request: Request, num_new: int, row: int, spec: list[int] = ()) -> ScheduledSeq:
        """The request's share of this step; advances its accounting as if the step had already run. ``spec``:
        proposals verified after its last token (their slots are allocated; rejected ones are rolled back)."""
        if request.spec_token_ids:
            request.spec_token_ids = []  # used now, or dropped: the proposer makes new ones after each step
        start = request.num_computed_tokens
        end = start + num_new
        all_token_ids = request.all_token_ids
        known = len(all_token_ids)
        pending = request.num_pending_tokens
        num_placeholders = max(0, end - known)
        # One step in flight at most, and it samples one token per request: at most one placeholder.
        assert num_placeholders <= 1 and num_placeholders <= pending, request
        token_ids = all_token_ids[start:end]
        if num_placeholders:
            token_ids.append(-1)  # all_token_ids[start:end] stopped at the known tokens
        if spec:
            token_ids += spec
        sample = end == known + pending
        # Positional, in field order (named in the comments): keyword arguments cost three times as much, and this
        # runs for every sequence every step.
        seq = ScheduledSeq(
            request.request_id,  # req_id
            token_ids,
            start,  # start_pos
            self.kv.get_block_ids(request),  # block_ids
            sample,
            request.sampling_params,
            request.seed,
            len(request.output_token_ids) + pending,  # num_output_tokens
            all_token_ids,  # history
            len(request.prompt_token_ids),  # num_prompt_tokens
            request.eos_token_ids,
            num_placeholders,
            request.pending_row if num_placeholders else -1,  # prev_row
            len(spec),  # num_spec_tokens
            request.lora_request,
            request.mm,
            request.prompt_logprobs is not None and start < len(request.prompt_token_ids) - 1,  # prompt_logprobs
            request.grammar,
        )
        request.num_computed_tokens = end + len(spec)
        if sample:
            request.num_pending_tokens += 1
            request.pending_row = row
        return seq

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        # In front: it was admitted before everything still waiting. Several victims of one step are
        # taken newest first, so pushing each to the front keeps them in admission order.
        self.waiting.appendleft(request)

    def _check_stop(self, request: Request) -> None:
        """Stop checks after a token is appended (once per token: a grammar's matcher advances here). A stop token,
        or a token that completes the grammar, wins over a length limit reached by the same token, so
        finish_reason says why the model stopped."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)  # called for every token: lengths, not the properties
        token = request.output_token_ids[-1]
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if params.stop_token_ids and token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return
        if request.grammar is not None and not request.grammar.accept(token):
            # Structured outputs: the token completes the grammar (a stop, even where it also reaches a length limit)
            request.status = RequestStatus.FINISHED_STOPPED
            return
        if len(request.all_token_ids) >= self.max_len or (
            params.max_tokens is not None and num_output >= params.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH
