"""LLMEngine: add requests, step, collect outputs. The one loop behind LLM.generate and the server.

The step loop is asynchronous (``async_scheduling``, on by default): each ``step()`` schedules and
dispatches step N+1 *before* reading step N's sampled tokens back, so the host's scheduling, input
building, dispatch, detokenizing and stop checks overlap the device's work on step N instead of
leaving it idle. Outputs therefore come one call late; stops are applied when the tokens are read, and
any token a stopped request computed meanwhile is dropped, never emitted.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Optional, Union

from jaxserve import prompt_logprobs, reasoning, token_rules
from jaxserve.engine_setup import EngineComponents, build_engine_components
from jaxserve.config import EngineArgs
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.lora.request import LoRARequest
from jaxserve.output_processor import OutputProcessor, RequestGroup, SampleState
from jaxserve.outputs import RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_metadata import MAX_BANNED
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import SchedulerOutput
from jaxserve.structured_output import Grammar, ReasoningGate

if TYPE_CHECKING:
    from jaxserve.model_runner import StepHandle

logger = logging.getLogger("jaxserve")

PromptType = Union[str, list[int], dict]


@dataclasses.dataclass
class EngineStats:
    """A snapshot for metrics and logs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prompt_tokens: int  # cumulative, prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int  # cumulative
    num_preemptions: int  # cumulative
    # Speculative decoding (cumulative; 0 and () without it), as vLLM's spec_decode counters.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # [k]: drafts whose proposal j was accepted
    # Multi-LoRA (empty without it): the adapters of the running and of the waiting requests, by name.
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()


class LLMEngine:
    """Owns the tokenizer, scheduler, model runner and output processor. Not thread-safe: one caller."""

    def __init__(self, components: EngineComponents) -> None:
        c = components
        self.args = c.args
        self.model_config = c.model_config
        self.scheduler_config = c.scheduler_config
        self.text_config = c.text_config
        self.tokenizer = c.tokenizer
        # prepare_prompt may run on LLM.generate's preprocessing threads; a fast tokenizer may change its
        # truncation state inside encode, which fails ("Already borrowed") when two threads do it at once.
        self._tokenizer_lock = threading.Lock()
        self.runner = c.runner
        self.scheduler = c.scheduler
        self.eos_token_ids = c.eos_token_ids
        self._grammar_compiler = None  # structured outputs' (jaxserve.structured_output), made on first use
        # A reasoning model's format and its tags' ids (jaxserve.reasoning): structured outputs wait for </think>.
        self.reasoning = c.reasoning
        self.output_processor = OutputProcessor(self.tokenizer)
        # While a step computes on an accelerator, the host detokenizes what deferred requests have so far
        # (OutputProcessor.catch_up_deferred). Not on CPU, where the host's Python and XLA's step share the cores.
        self._detokenize_while_waiting = self.tokenizer is not None and self.runner.runner_config.platform != "cpu"
        self._rng = random.Random(self.model_config.seed)
        self.async_scheduling = self.args.async_scheduling
        self.speculator = c.speculator  # None unless speculative_config is set (jaxserve.spec_decode)
        if self.runner.lora is not None:  # an adapter's requests wait until its weights are read, the rest run
            self.scheduler.lora_ready = self.runner.lora.is_ready
        self.mm_processor = getattr(c, "mm_processor", None)  # vision-language models only
        self._in_flight: Optional[tuple[SchedulerOutput, StepHandle]] = None  # dispatched, not yet read
        # With speculation: the last step's applied output, whose processing runs during the next verify step, and
        # outputs that processing gave outside a step (an abort flushed it), for the next step() to return.
        self._deferred: Optional[tuple[list[Request], dict, Any]] = None
        self._held_outputs: list[RequestOutput] = []
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0
        # Where the loop's time goes: seconds inside step() in all, and of those, blocked reading a
        # step's tokens back (the host waiting for the device). host = total - wait.
        # propose_s: with speculation, the proposer's share of total_s (a draft round waits for its proposals)
        self.loop_time = {"steps": 0, "total_s": 0.0, "wait_s": 0.0, "propose_s": 0.0}

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: bool = True) -> "LLMEngine":
        """One engine; with data_parallel_size > 1, a DPEngine of that many replicas (same interface); for an
        embedding model (runner="pooling", or "auto" on an embedding checkpoint) a PoolingEngine."""
        from jaxserve.pooling_engine import PoolingEngine, resolve_runner

        if resolve_runner(args) == "pooling":
            return PoolingEngine.from_engine_args(args, progress=progress)
        if args.data_parallel_size > 1:
            from jaxserve.dp_engine import DPEngine

            return DPEngine.from_engine_args(args, progress=progress)
        return cls(build_engine_components(args, progress=progress))

    # ------------------------------------------------------------------ requests

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """Accepts a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")  # both given (e.g. already tokenized by DPEngine): keep the text too
                _, ids = self.tokenize_prompt(list(prompt["prompt_token_ids"]))
                return (text if isinstance(text, str) else None), ids
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give some text or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, but skip_tokenizer_init=True; pass prompt_token_ids")
            with self._tokenizer_lock:
                return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids, or a dict; got {type(prompt).__name__}")

    def prepare_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int], Any]:
        """(text, token ids, MultiModalInputs or None). A dict may carry ``multi_modal_data``
        ({"image": PIL image or list}): its placeholders are expanded and the images preprocessed; or
        ``mm_inputs``, the result of an earlier call (ids already expanded). Thread-safe: LLM.generate
        runs it on a pool."""
        if not isinstance(prompt, dict):
            return (*self.tokenize_prompt(prompt), None)
        if "mm_inputs" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"]), prompt["mm_inputs"]
        data = prompt.get("multi_modal_data")
        text, ids = self.tokenize_prompt({k: v for k, v in prompt.items() if k != "multi_modal_data"})
        if self.mm_processor is None:
            if data:
                raise ValueError(
                    f"multi_modal_data was given but {self.model_config.served_model_name} is a text-only model; "
                    "serve a vision-language model (Qwen2-VL) to send images"
                )
            return text, ids, None
        from jaxserve.multimodal import images_of

        ids, mm = self.mm_processor.process(ids, images_of(data))
        return text, ids, mm

    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        max_len = self.model_config.max_model_len
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens long, but max_model_len={max_len} leaves no room to generate; "
                f"shorten the prompt to at most {max_len - 1} tokens or raise max_model_len"
            )
        vocab = self.text_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if params.min_tokens and len(params.stop_token_ids) + len(self.eos_token_ids) > MAX_BANNED:
            raise ValueError(
                f"min_tokens={params.min_tokens} with {len(params.stop_token_ids)} stop_token_ids: at most "
                f"{MAX_BANNED - len(self.eos_token_ids)} stop_token_ids can be held back until min_tokens"
            )
        if params.logprobs is not None and params.logprobs > self.args.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.args.max_logprobs}")
        if params.logit_bias:
            outside = next((t for t in params.logit_bias if t >= vocab), None)
            if outside is not None:
                raise ValueError(f"logit_bias={{{outside}: ...}} is invalid: token id {outside} is outside the "
                                 f"vocabulary [0, {vocab})")
        if params.prompt_logprobs is not None:
            if params.prompt_logprobs > self.args.max_logprobs:
                raise ValueError(
                    f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs={self.args.max_logprobs}"
                )
            if self.args.speculative_config is not None:
                raise ValueError(
                    "prompt_logprobs is not supported with speculative decoding (its verify steps score only the "
                    "proposals); leave prompt_logprobs unset or start the engine without speculative_config"
                )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        """Queue a request; raises ValueError for bad input without disturbing other requests.
        ``lora_request``: run it with that PEFT adapter (needs enable_lora); checked here (a bad adapter raises
        ValueError), read in the background; the request waits for it, others do not."""
        params = params or SamplingParams()
        if request_id in self.output_processor.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, prompt_ids, mm = self.prepare_prompt(prompt)
        if mm is None and self.mm_processor is not None:
            self.mm_processor.process(prompt_ids, [])  # image placeholders without images are an error
        self.validate_prompt(prompt_ids, params)
        if lora_request is not None:
            self.add_lora(lora_request)
        room = self.model_config.max_model_len - len(prompt_ids)
        if params.max_tokens is None or params.max_tokens > room:
            params = params.clone(max_tokens=room, min_tokens=min(params.min_tokens, room))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        grammar = self._token_constraint(params, prompt_ids)
        samples = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            seed = self._seed_for(params.seed, i)
            req = Request(
                child_id, prompt_ids, params, self.eos_token_ids, seed=seed, arrival_time=arrival,
                lora_request=lora_request, mm=mm,
            )  # fmt: skip
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
            if params.prompt_logprobs is not None and i == 0:  # one sample computes them for the group
                req.prompt_logprobs = prompt_logprobs.Rows(len(prompt_ids), params.prompt_logprobs)
            if grammar is not None:  # each sample walks the grammar on its own
                req.grammar = grammar if i == 0 else grammar.copy()
            samples.append(SampleState(request=req, index=i, detokenizer=detok))
        group = RequestGroup(request_id, text, prompt_ids, samples, arrival)
        self.output_processor.add(group)
        for s in samples:
            self.scheduler.add_request(s.request)

    def _token_constraint(self, params: SamplingParams, prompt_ids: list[int]):
        """The request's structured_output.Grammar: its structured_outputs' matcher and its token rules
        (allowed_token_ids, bad_words), or None when it has neither. ValueError naming the field when one is bad.
        A reasoning model's matcher waits for the end of the reasoning the prompt leaves the reply to do."""
        if not params.uses_token_mask:
            return None
        rules = token_rules.build_token_rules(params, self.tokenizer, self.text_config.vocab_size)
        if params.structured_outputs is None:
            return Grammar(None, token_rules.mask_words(self.text_config.vocab_size), rules)
        grammar = self._compile_grammar(params)
        grammar.rules = rules
        if self.reasoning is not None and not self.args.structured_outputs_in_reasoning:
            fmt, start_id, end_id = self.reasoning
            state = reasoning.prompt_state_of_ids(fmt, self.tokenizer, prompt_ids)
            if state != reasoning.ANSWERING:
                grammar.gate = ReasoningGate(state, start_id, end_id)
        return grammar

    def _compile_grammar(self, params: SamplingParams):
        """A matcher for the request's structured_outputs (jaxserve.structured_output); ValueError if it does not
        compile. The engine's compiler is made on the first such request."""
        if self._grammar_compiler is None:
            from jaxserve.structured_output import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.text_config.vocab_size, self.eos_token_ids)
        return self._grammar_compiler.compile(params.structured_outputs)

    # ------------------------------------------------------------------ LoRA adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter (config and weight-file header; raises ValueError naming what is wrong) and start
        reading its tensors in the background (vLLM's add_lora)."""
        if self.runner.lora is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} asked for, but this engine runs without LoRA: start it "
                "with enable_lora=True (--enable-lora)"
            )
        self.runner.lora.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its host copy and device slot). Requests still using it must have finished."""
        if self.runner.lora is None:
            return False
        if any(r.lora_int_id == lora_int_id for r in self.scheduler.requests.values()):
            raise ValueError(f"LoRA adapter id {lora_int_id} is in use by unfinished requests; unload it after they end")
        return self.runner.lora.remove(lora_int_id)

    def _abort_failed_loras(self) -> list[RequestOutput]:
        """Abort the requests of adapters whose weights failed to read in the background (logged there)."""
        lora = self.runner.lora
        if lora is None or not lora.failed:
            return []
        failed = set(lora.failed)
        groups = {g.request_id for g in self.output_processor.groups.values()
                  if any(s.request.lora_int_id in failed for s in g.samples)}  # fmt: skip
        for lora_id in failed:
            lora.remove(lora_id)
        return self.abort_request(sorted(groups))

    def list_loras(self) -> set[int]:
        return set(self.runner.lora.requests) if self.runner.lora is not None else set()

    def _seed_for(self, seed: Optional[int], index: int) -> int:
        """Per-sample seed: the user's seed (mixed with the sample index for n > 1) or a fresh one."""
        if seed is None:
            return self._rng.getrandbits(32)
        return (seed * 1_000_003 + index) & 0xFFFFFFFF if index else seed & 0xFFFFFFFF

    def abort_request(self, request_ids: Union[str, list[str]]) -> list[RequestOutput]:
        """Stop requests at once and free their KV blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        # The last step's deferred processing first: its tokens belong in an aborted request's output. Other
        # requests' outputs from it wait for the next step() (has_unfinished_requests says there is one).
        self._held_outputs += self._flush_deferred()
        outputs = []
        for rid in request_ids:
            children = self.output_processor.child_ids(rid)
            if not children:
                continue
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.abort(rid)
            if out is not None:
                outputs.append(out)
        if self._held_outputs and outputs:  # an aborted request's final output replaces its held one
            aborted = {out.request_id for out in outputs}
            self._held_outputs = [out for out in self._held_outputs if out.request_id not in aborted]
        return outputs

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """Dispatch the next model step, then read back the previous one; returns the outputs of the
        requests that progressed (with async scheduling off, of the step just run)."""
        start = time.perf_counter()
        if self.speculator is not None:
            outputs = self._speculative_step()
            self.loop_time["steps"] += 1
            self.loop_time["total_s"] += time.perf_counter() - start
            return outputs
        outputs: list[RequestOutput] = self._abort_failed_loras()
        if self._deferred is not None or self._held_outputs:  # left by speculative steps (speculation switched off)
            outputs = self._held_outputs + self._flush_deferred() + outputs
            self._held_outputs = []
        defers_masks = self.runner.defers_masks
        if self._in_flight is not None and self.scheduler.has_pending_host_token_rows(grammar=not defers_masks):
            # Penalties read the whole history on the host (and, where the sampler cannot wait, a grammar its last
            # token): let the in-flight step arrive first.
            outputs += self._finish(*self._in_flight)
            self._in_flight = None
        sched = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        # A grammar's mask follows the token in flight: launch the model now, and its sampler once that token
        # has been read back and taken by the grammar (while the model runs).
        mask_waits = defers_masks and previous is not None and any(
            seq.grammar is not None and seq.num_placeholders for seq in sched.seqs)
        if not sched.is_empty:
            self._in_flight = (sched, self.runner.dispatch(sched, defer_masks=mask_waits))
            self._count_prompt_tokens(sched)
        if previous is not None:
            applied = self._apply(*previous)
            if mask_waits:
                self.runner.sample_deferred(self._in_flight[1])
            outputs += self._process(*applied)
        if not self.async_scheduling and self._in_flight is not None:
            outputs += self._finish(*self._in_flight)
            self._in_flight = None
        if sched.is_empty and previous is None and self.runner.lora is not None:
            # Nothing ran: the requests left wait for an adapter's read. Wait for it rather than spin (a spinning
            # loop would also take the GIL from the reading thread).
            self.runner.lora.wait_for_reads(timeout=0.01)
        self.loop_time["steps"] += 1
        self.loop_time["total_s"] += time.perf_counter() - start
        return outputs

    def _speculative_step(self) -> list[RequestOutput]:
        """Schedule, verify the proposals, read back, propose again: one step at a time, since the next step's
        proposals depend on what this one accepts (jaxserve.spec_decode.speculator).

        The one piece of a step's host work that the next step does not need is its output processing
        (detokenizing, stop strings, RequestOutputs): it is deferred to the next call and runs there between the
        verify step's launch and its read back, while the device computes. So outputs come one call late, as in
        the asynchronous loop, and a stop string ends its request one step late: the step computed meanwhile is
        dropped for it (its row is skipped as a finished request's). A step in which a request finished (EOS, a
        stop token, a length limit) is processed at once, so a final output comes without delay; otherwise
        ``has_unfinished_requests`` stays true while an output waits, so the caller's loop makes the call."""
        sched = self.scheduler.schedule()
        outputs, self._held_outputs = self._held_outputs, []
        if sched.is_empty:
            self.speculator.materialize()  # proposals left on the device for a verify step that did not come
            return outputs + self._flush_deferred()
        self._count_prompt_tokens(sched)
        handle = self.speculator.dispatch(sched, self.scheduler.kv)
        outputs += self._flush_deferred()  # while the device runs the verify step
        applied = self._apply(sched, handle)
        propose_start = time.perf_counter()
        self.speculator.propose(self.scheduler.running, self.scheduler.kv)
        self.loop_time["propose_s"] += time.perf_counter() - propose_start
        if any(r.status.finished for r in applied[0]):
            outputs += self._process(*applied)
        else:
            self._deferred = applied
        return outputs

    def _flush_deferred(self) -> list[RequestOutput]:
        """Process the output of the last speculative step now, if it was deferred."""
        deferred, self._deferred = self._deferred, None
        return self._process(*deferred) if deferred is not None else []

    def _finish(self, sched: SchedulerOutput, handle: "StepHandle") -> list[RequestOutput]:
        """Read a dispatched step's tokens back and apply them: stops, detokenizing, outputs."""
        return self._process(*self._apply(sched, handle))

    def _apply(self, sched: SchedulerOutput, handle: "StepHandle") -> tuple[list[Request], dict, Any]:
        """Read a dispatched step's tokens back and apply them to the requests (tokens, stop checks, blocks):
        (requests updated, their logprobs rows, the runner's output), for ``_process``."""
        wait_start = time.perf_counter()
        if self.speculator is not None:
            runner_out = self.speculator.fetch(sched, handle)
            before = sum(r.num_output_tokens for r in sched.requests)
        else:
            if self._detokenize_while_waiting:  # counted as waiting: it only runs while the device computes
                self.output_processor.catch_up_deferred(lambda: not self.runner.ready(handle))
            runner_out = self.runner.fetch(handle)
        self.loop_time["wait_s"] += time.perf_counter() - wait_start
        if runner_out.prompt_logprobs is not None:
            prompt_logprobs.store(sched.seqs, sched.requests, runner_out.prompt_logprobs)
        # Each request's row, for its logprobs: only a step that returned logprobs needs them.
        rows = {}
        if runner_out.sampled_logprobs is not None:
            rows = {seq.req_id: i for i, seq in enumerate(sched.seqs) if seq.sample}
        updated = self.scheduler.update_from_output(sched, runner_out)
        if self.speculator is not None:  # several tokens a row
            self.num_generation_tokens += sum(r.num_output_tokens for r in sched.requests) - before
        else:
            self.num_generation_tokens += len(updated)
        return updated, rows, runner_out

    def _process(self, updated: list[Request], rows: dict, runner_out) -> list[RequestOutput]:
        """Detokenize, apply stop strings (finishing those requests) and build the outputs of an applied step."""
        outputs, stopped = self.output_processor.process(updated, rows, runner_out)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _count_prompt_tokens(self, sched: SchedulerOutput) -> None:
        for seq in sched.seqs:
            if seq.start_pos < seq.num_prompt_tokens:
                self.num_prompt_tokens += min(len(seq.token_ids), seq.num_prompt_tokens - seq.start_pos)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or (with speculation) a step's outputs still to be returned by step()."""
        return self.scheduler.has_unfinished_requests() or self._deferred is not None or bool(self._held_outputs)

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=getattr(s, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(s, "prefix_cache_hits", 0),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=getattr(s, "num_preemptions", 0),
            **(self.speculator.stats.engine_stats() if self.speculator is not None else {}),
            **(_lora_names(s) if self.runner.lora is not None else {}),
        )

    def info(self) -> dict[str, Any]:
        """What was built: for logs, /version and benchmarks."""
        return {
            "model": self.model_config.served_model_name,
            "dtype": self.model_config.dtype,
            "fp32_matmul_precision": self.model_config.fp32_matmul_precision,
            "max_model_len": self.model_config.max_model_len,
            "max_num_seqs": self.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler_config.max_num_batched_tokens,
            "num_kv_blocks": self.runner.num_blocks,
            "kv_cache_dtype": self.runner.kv_dtype.name,
            "block_size": self.runner.block_size,
            "kv_cache_gib": round(self.runner.kv_cache_bytes / (1 << 30), 3),
            "token_buckets": self.runner.token_buckets,
            "precompile": self.runner.runner_config.precompile,
            "compiled_step_shapes": len(self.runner.compiled_shapes),
            "attention_backend": self.runner.runner_config.attention_backend,
            "async_scheduling": self.async_scheduling,
            "tensor_parallel_size": self.runner.mesh.shape["model"],
            "data_parallel_size": 1,
            "speculative_config": None if self.speculator is None else dataclasses.asdict(self.speculator.config),
            "lora": None if self.runner.lora_config is None else dataclasses.asdict(self.runner.lora_config),
            "vision": None if getattr(self.runner, "vision", None) is None else self.runner.vision.info(),
        }


def _lora_names(scheduler) -> dict[str, tuple[str, ...]]:
    """EngineStats' lora_running / lora_waiting: sorted adapter names (vLLM's lora_requests_info labels)."""

    def names(requests) -> tuple[str, ...]:
        return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))

    return {"lora_running": names(scheduler.running), "lora_waiting": names(scheduler.waiting)}
