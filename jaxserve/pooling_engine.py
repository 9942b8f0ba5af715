"""PoolingEngine: the embedding counterpart of LLMEngine, with the same driving interface (add_request,
step, abort_request, has_unfinished_requests, get_stats, info), so LLM and the async server drive either.

Requests are prefill-only: each runs in one step and leaves no state behind. The loop overlaps as the
generate loop does: step N+1 is dispatched before step N's pooled vectors are read back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional, Union

from jaxserve.config import EngineArgs, ModelConfig, SchedulerConfig
from jaxserve.pooling_params import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from jaxserve.pooling_scheduler import PoolingRequest, PoolingScheduler

logger = logging.getLogger("jaxserve")

PromptType = Union[str, list[int], dict]
# The longest default context of a pooling model: a step holds a whole prompt, and attention runs over rows of
# max_model_len rounded up to a power of two (Qwen3-Embedding-8B declares 40960 positions: one row of 65536
# would take a [32, 65536, 65536] score tensor).
DEFAULT_MAX_LEN = 8192
# vLLM's older `task=` spellings and the runner each means (jaxserve.config.TASKS lists the same keys).
_TASK_RUNNER = {"embed": "pooling", "embedding": "pooling", "generate": "generate", "auto": "auto"}


def resolve_runner(args: EngineArgs) -> str:
    """"generate" or "pooling": ``runner`` / ``task`` when given, else what the checkpoint is."""
    from jaxserve.model_loader import resolve_model_path
    from jaxserve.models.loader.pooling_config import is_pooling_checkpoint

    runner = args.runner
    if args.task is not None:
        by_task = _TASK_RUNNER[args.task]
        if runner not in ("auto", by_task) and by_task != "auto":
            raise ValueError(
                f"task={args.task!r} asks for runner={by_task!r} but runner={runner!r}; give one of the two"
            )
        runner = by_task if by_task != "auto" else runner
    if runner != "auto":
        return runner
    if args.model is None:
        return "generate"
    path, _ = resolve_model_path(args.model, args.load_format)
    return "pooling" if is_pooling_checkpoint(path) else "generate"


def pooling_limits(
    args: EngineArgs, model_max: int, st_max: Optional[int], platform: str
) -> tuple[int, int, int, int]:
    """(max_model_len, max_num_batched_tokens, max_num_seqs, row_len) of a pooling engine.

    A prompt runs whole in one step, so the token budget holds a longest prompt: an unset budget grows to
    max_model_len, an unset max_model_len shrinks to a given budget (and to sentence-transformers'
    max_seq_length, and to DEFAULT_MAX_LEN); both given and incompatible is an error. Attention runs in rows
    of ``row_len``, the power of two >= max_model_len; a budget above it is rounded down to whole rows (a budget
    up to it is one row)."""
    limit = min(model_max, st_max or model_max)
    given_len, given_budget = args.max_model_len, args.max_num_batched_tokens
    if given_len is not None and given_len > model_max:
        raise ValueError(
            f"max_model_len={given_len} exceeds the {model_max} positions the model takes; use at most {model_max}"
        )
    if given_len is not None and given_budget is not None and given_budget < given_len:
        raise ValueError(
            f"max_num_batched_tokens={given_budget} is smaller than max_model_len={given_len}; a pooling prompt runs "
            "whole in one step: raise max_num_batched_tokens or lower max_model_len"
        )
    max_len = given_len or min(limit, DEFAULT_MAX_LEN, given_budget or limit)
    if given_len is None and max_len < limit:
        logger.info(
            "max_model_len is %d for pooling (the model allows %d; a prompt runs whole in one step, with attention "
            "over rows of that length): set --max-model-len (and --max-num-batched-tokens) for longer inputs",
            max_len, limit,
        )  # fmt: skip
    budget = given_budget or max(256 if platform == "cpu" else 2048, max_len)
    row_len = 1 << (max_len - 1).bit_length()
    if budget <= row_len:
        row_len = budget
    budget -= budget % row_len
    max_num_seqs = min(args.max_num_seqs or (64 if platform == "cpu" else 256), budget)
    return max_len, budget, max_num_seqs, row_len


def encode_text(tokenizer, text: str, keep: Optional[int], add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``; with ``keep``, truncated by the tokenizer itself to ``keep`` tokens (its own side
    and special tokens, as sentence-transformers truncates)."""
    if keep is None:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return list(tokenizer(text, truncation=True, max_length=keep, add_special_tokens=add_special_tokens)["input_ids"])


@dataclasses.dataclass(frozen=True)
class _EncoderHeads:
    """An encoder's head counts as check_tensor_parallel reads them (its K/V heads are its query heads)."""

    num_attention_heads: int

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads


class PoolingEngine:
    """Owns the tokenizer, the pooling scheduler and the runners. Not thread-safe: one caller.

    Data parallelism runs in this process: one PoolingRunner per replica (its own weights on its own
    ``tensor_parallel_size`` devices), and each step hands every replica the next batch the scheduler packs.
    The generate engine needs a process per replica because its loop is host-bound (a step per token, with
    scheduling, input building and detokenizing each time); a pooling step is one dispatch for a whole batch of
    whole prompts, the host's share is packing token ids into a few arrays, and dispatch returns at once (the
    device runs asynchronously), so one thread keeps every replica busy and no router, IPC or second tokenizer
    is needed.
    """

    is_pooling = True

    def __init__(
        self, args, model_config, scheduler_config, tokenizer, runners, vocab_size: int, compile_s: float, row_len: int
    ):  # fmt: skip
        self.args = args
        self.model_config = model_config
        self.scheduler_config = scheduler_config
        self.tokenizer = tokenizer
        self.runners = runners if isinstance(runners, list) else [runners]
        self.runner = runner = self.runners[0]
        self.pooling = runner.pooling
        self.vocab_size = vocab_size
        self.row_len = row_len
        self.scheduler = PoolingScheduler(
            scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens, row_len
        )
        self._in_flight: list = []  # (requests, handle) per replica: dispatched, not yet read back
        self.num_prompt_tokens = 0
        self.compile_s = compile_s

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: bool = True) -> "PoolingEngine":
        import jax.numpy as jnp

        from jaxserve.engine_setup import (
            _default_served_name, _tokenizer_or_none, current_platform, enable_compilation_cache, serving_dtype,
        )  # fmt: skip
        from jaxserve.model_loader import resolve_model_path
        from jaxserve.models.loader.embedding import load_embedding_model, max_input_len, read_embedding_config
        from jaxserve.models.loader.pooling_config import read_pooling_config
        from jaxserve.pooling_runner import PoolingRunner

        from jaxserve import sharding

        args.validate()
        if args.enable_lora:
            raise ValueError("enable_lora=True: LoRA adapters are served for generation only, not by the embedding "
                             "(pooling) runner; leave it off")
        tp, dp = args.tensor_parallel_size, args.data_parallel_size
        meshes = sharding.replica_meshes(sharding.make_mesh(tp, dp))  # raises naming both when devices are short
        platform = current_platform()
        enable_compilation_cache(args.compilation_cache_dir)
        path, fmt = resolve_model_path(args.model, args.load_format)
        dtype = serving_dtype(args.dtype, platform)
        t0 = time.perf_counter()
        cfg, is_encoder = read_embedding_config(path)
        if tp > 1:  # whole heads per device, checked before any weight is read
            sharding.check_tensor_parallel(cfg if not is_encoder else _EncoderHeads(cfg.num_attention_heads), tp)
        pooling = read_pooling_config(path, is_encoder=is_encoder)
        max_model_len, budget, max_num_seqs, row_len = pooling_limits(
            args, max_input_len(cfg, is_encoder), pooling.max_seq_length, platform
        )
        em = load_embedding_model(
            path, fmt, dtype=jnp.dtype(dtype), seed=args.seed, fp32_matmul_precision=args.fp32_matmul_precision,
            progress=progress, row_len=row_len, shardings_fn=sharding.shardings_fn(meshes[0]),
        )  # fmt: skip
        tokenizer = None if args.skip_tokenizer_init else _tokenizer_or_none(path, fmt, args.tokenizer)
        load_s = time.perf_counter() - t0
        served = args.served_model_name or _default_served_name(args.model, path)
        model_config = ModelConfig(path, fmt, served, dtype, max_model_len, args.seed, args.fp32_matmul_precision)
        scheduler_config = SchedulerConfig(max_num_seqs, budget, max_model_len, False, 0)
        precompile = "none" if args.precompile == "none" else "all"
        # Data parallelism: one runner per mesh row, in this process (see the class docstring for why).
        runners = [
            PoolingRunner(em, pooling, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, precompile=precompile,
                          mesh=mesh)  # fmt: skip
            for mesh in meshes
        ]
        del em
        compile_s = sum(r.warmup(progress=progress) for r in runners)
        logger.info(
            "jaxserve ready (pooling): %s (%s, %s, %s pooling%s, tp=%d, dp=%d) loaded in %.1fs, %d step shapes "
            "compiled in %.1fs", served, "encoder" if is_encoder else "decoder", dtype, pooling.pooling_type,
            ", normalized" if pooling.normalize else "", tp, dp, load_s, len(runners[0].compiled_shapes), compile_s,
        )  # fmt: skip
        return cls(args, model_config, scheduler_config, tokenizer, runners, cfg.vocab_size, compile_s, row_len)

    # ------------------------------------------------------------------ requests

    def tokenize_prompt(
        self, prompt: PromptType, params: Optional[PoolingParams] = None
    ) -> tuple[Optional[str], list[int]]:
        """A string, token ids, {"prompt": str} or {"prompt_token_ids": [...]} -> (text, ids), truncated as
        ``params.truncate_prompt_tokens`` asks (see PoolingParams)."""
        params = params or PoolingParams()
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                _, ids = self.tokenize_prompt(list(prompt["prompt_token_ids"]), params)
                return (text if isinstance(text, str) else None), ids
            if "prompt" not in prompt:
                raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            prompt = prompt["prompt"]
        keep = self._truncation(params)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give some text or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, but skip_tokenizer_init=True; pass prompt_token_ids")
            return prompt, encode_text(self.tokenizer, prompt, keep)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            return None, ids[-keep:] if keep is not None else ids
        raise ValueError(f"prompt must be a string, a list of token ids, or a dict; got {type(prompt).__name__}")

    def _truncation(self, params: PoolingParams) -> Optional[int]:
        keep = params.truncate_prompt_tokens
        max_len = self.model_config.max_model_len
        if keep == -1:
            return max_len
        if keep is not None and keep > max_len:
            raise ValueError(f"truncate_prompt_tokens={keep} exceeds max_model_len={max_len}; use at most {max_len}")
        return keep

    def validate_prompt(self, prompt_ids: list[int], params: PoolingParams) -> None:
        max_len = self.model_config.max_model_len
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(prompt_ids) > max_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens long, but max_model_len={max_len}; shorten it, or set "
                f"truncate_prompt_tokens (-1 keeps the first {max_len} tokens of a text, the last of token ids)"
            )
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        dims, allowed = params.dimensions, self.pooling.matryoshka_dimensions
        if dims is not None:
            if allowed is None:
                raise ValueError(
                    f"dimensions={dims} is invalid: model {self.model_config.served_model_name!r} does not support "
                    "Matryoshka embeddings (its config.json declares neither is_matryoshka nor matryoshka_dimensions)"
                )
            hidden = self.runner.hidden_size
            if dims > hidden or (allowed and dims not in allowed):
                want = f"one of {list(allowed)}" if allowed else f"at most {hidden}"
                raise ValueError(f"dimensions={dims} is invalid for this model: choose {want}")

    def add_request(
        self, request_id: str, prompt: PromptType, params: Optional[PoolingParams] = None,
        arrival_time: Optional[float] = None,
    ) -> None:  # fmt: skip
        """Queue a request; raises ValueError for bad input without disturbing other requests."""
        if params is not None and not isinstance(params, PoolingParams):
            raise ValueError(
                f"this engine runs an embedding model (runner='pooling'); it takes PoolingParams, not "
                f"{type(params).__name__}: it cannot generate text. Load a generative model to generate"
            )
        params = params or PoolingParams()
        if request_id in self.scheduler.waiting:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt, params)
        self.validate_prompt(ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.scheduler.add_request(PoolingRequest(request_id, ids, params, arrival, text))

    def abort_request(self, request_ids: Union[str, list[str]]) -> list[EmbeddingRequestOutput]:
        """Drop waiting requests (one already dispatched finishes anyway: it is one step)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        return [
            EmbeddingRequestOutput(r.request_id, None, r.prompt_token_ids, r.prompt, finish_reason="abort")
            for r in self.scheduler.abort(request_ids)
        ]

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[EmbeddingRequestOutput]:
        """Dispatch the next batch on every replica (while requests wait), then read back the previous step's."""
        previous, self._in_flight = self._in_flight, []
        for runner in self.runners:
            batch = self.scheduler.schedule()
            if not batch:
                break
            handle = runner.dispatch([(r.prompt_token_ids, at) for r, at in batch])
            self._in_flight.append(([r for r, _ in batch], handle))
            self.num_prompt_tokens += sum(len(r.prompt_token_ids) for r, _ in batch)
        outputs = [out for flight in previous for out in self._finish(*flight)]
        if not self.args.async_scheduling:
            outputs += [out for flight in self._in_flight for out in self._finish(*flight)]
            self._in_flight = []
        return outputs

    def _finish(self, batch: list[PoolingRequest], handle) -> list[EmbeddingRequestOutput]:
        from jaxserve.pooling_runner import finish_embedding

        pooled = self.runner.fetch(handle)  # [S, D]
        outputs = []
        for req, row in zip(batch, pooled):
            p = req.params
            normalize = self.pooling.normalize if p.normalize is None else p.normalize
            vec = finish_embedding(row, normalize=normalize, dimensions=p.dimensions)
            out = EmbeddingOutput(vec.tolist())
            outputs.append(EmbeddingRequestOutput(req.request_id, out, req.prompt_token_ids, req.prompt))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def get_stats(self):
        from jaxserve.llm_engine import EngineStats

        running = sum(len(reqs) for reqs, _ in self._in_flight)
        return EngineStats(running, self.scheduler.num_waiting, 0.0, 0, 0, self.num_prompt_tokens, 0, 0)

    def info(self) -> dict[str, Any]:
        return {
            "model": self.model_config.served_model_name,
            "runner": "pooling",
            "pooling_type": self.pooling.pooling_type,
            "normalize": self.pooling.normalize,
            "dtype": self.model_config.dtype,
            "max_model_len": self.model_config.max_model_len,
            "max_num_seqs": self.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler_config.max_num_batched_tokens,
            "token_buckets": self.runner.token_buckets,
            "attention_row_len": self.row_len,
            "compiled_step_shapes": len(self.runner.compiled_shapes),
            "async_scheduling": self.args.async_scheduling,
            "tensor_parallel_size": self.args.tensor_parallel_size,
            "data_parallel_size": len(self.runners),
        }
