"""DPEngine: data parallelism as independent engine replicas, each in its own process, behind a router.

Each replica is a whole LLMEngine (its own scheduler, KV cache and weights) on its own group of
``tensor_parallel_size`` devices, run by an engine core process (jaxserve.engine_core_proc) with its own
Python interpreter, so the replicas' host work never waits for one GIL. Replicas never talk to each other:
a request lives on one replica from admission to finish, so no collective crosses replicas.

This process, the router, keeps the tokenizer, tokenizes and validates prompts (so bad input fails here
with LLMEngine's own errors), sends each request to the least-loaded replica, and collects the outputs
the replicas send back after each of their steps. DPEngine has LLMEngine's interface (add_request / step /
abort_request / has_unfinished_requests / get_stats / info, the prompt checks, tokenizer, model_config,
text_config, scheduler_config, eos_token_ids), so ``LLM``, the async engine and the HTTP server run on it
unchanged.

``step()`` returns the outputs that have arrived; with none arrived yet and requests in flight it waits
for the first, but at most ``_WAIT_S``, so that a caller adding requests (the async engine's thread)
gets them to an idle replica without waiting for a busy one's step. ``abort_request`` waits for the
replicas' answers, so that, as with LLMEngine, it returns the aborted requests' final outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable, Optional, Union

from jaxserve.config import EngineArgs
from jaxserve.llm_engine import EngineStats, LLMEngine, PromptType
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.replica_client import EngineCoreClient, EngineCoreError, replica_environments, visible_devices
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")

_WAIT_S = 0.01  # longest a step() waits for outputs (see the module docstring)


@dataclasses.dataclass
class _Placement:
    replica: int
    tokens: int  # prompt tokens + tokens it may still generate: the router's estimate of its work
    prompt: Optional[str]  # put back into the replica's outputs, which travel without the prompt
    prompt_token_ids: list[int]


class DPEngine:
    """``data_parallel_size`` LLMEngine replicas in their own processes; each request goes to the least-loaded."""

    def __init__(self, args: EngineArgs, replicas: list[EngineCoreClient]) -> None:
        first = replicas[0].ready
        self.args = args
        self.replicas = replicas
        self.model_config = first["model_config"]
        self.scheduler_config = first["scheduler_config"]
        self.text_config = first["text_config"]
        self.tokenizer = first["tokenizer"]
        self._tokenizer_lock = threading.Lock()  # LLMEngine.tokenize_prompt's, which this engine borrows
        self.eos_token_ids = first["eos_token_ids"]
        self._grammar_compiler = None  # LLMEngine._compile_grammar's, which this engine borrows (below)
        self.reasoning = None  # the replicas hold structured outputs back through reasoning; this copy only checks
        self._placements: dict[str, _Placement] = {}
        self._outputs: list[RequestOutput] = []  # arrived, not yet returned by step()
        self._replies: dict[int, Any] = {}  # seq -> an abort's or rpc's answer
        self._seq = itertools.count()
        self._loras: set[LoRARequest] = set()  # adapters every replica has read and checked
        self._close = weakref.finalize(self, _close_all, list(replicas))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: bool = True) -> "DPEngine":
        from jaxserve import sharding
        from jaxserve.model_loader import read_text_config, resolve_model_path

        args.validate()
        tp, dp = args.tensor_parallel_size, args.data_parallel_size
        platform, count = visible_devices()
        sharding.check_device_count(tp, dp, count, platform)  # cheap checks first: no process for a bad config
        if tp > 1:
            sharding.check_tensor_parallel(read_text_config(resolve_model_path(args.model, args.load_format)[0]), tp)
        # With the persistent compilation cache on, replicas > 0 compile after replica 0 is ready and find
        # its executables there (their loading still overlaps replica 0's); without it, all compile at once.
        cache_on = args.compilation_cache_dir != ""
        init = {"args": args, "progress": progress, "sys_path": list(sys.path),
                "log_level": logging.getLogger("jaxserve").getEffectiveLevel()}
        replicas: list[EngineCoreClient] = []
        try:
            for i, (ids, env, cpus) in enumerate(replica_environments(platform, tp, dp)):
                logger.info("starting data-parallel replica %d/%d on %s devices %s%s", i + 1, dp, platform, ids,
                            f", CPU cores {cpus}" if cpus else "")
                # Only replica 0 draws progress bars: the others build the same engine at the same time.
                replicas.append(EngineCoreClient(
                    i, ids, env, cpus, {**init, "progress": progress and i == 0, "wait_for_warmup": cache_on and i > 0}
                ))  # fmt: skip
            _wait_ready(replicas, release_after_first=cache_on)
        except BaseException:
            _close_all(replicas)
            raise
        return cls(args, replicas)

    # ------------------------------------------------------------------ routing

    def replica_load(self, index: int) -> tuple[int, int]:
        """(unfinished requests, their estimated tokens) on replica ``index``; the router picks the smallest."""
        placed = [p for p in self._placements.values() if p.replica == index]
        return len(placed), sum(p.tokens for p in placed)

    def _pick_replica(self) -> int:
        return min(range(len(self.replicas)), key=lambda i: (*self.replica_load(i), i))

    # ------------------------------------------------------------------ LLMEngine's interface

    def tokenize_prompt(self, prompt: PromptType):
        return LLMEngine.tokenize_prompt(self, prompt)  # the same rules; it only reads the attributes we share

    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        LLMEngine.validate_prompt(self, prompt_ids, params)

    # A request's constraint is built here once, only to check it: the replica builds its own.
    _token_constraint = LLMEngine._token_constraint
    _compile_grammar = LLMEngine._compile_grammar

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        if request_id in self._placements:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, prompt_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(prompt_ids, params)
        # A constraint that does not compile (or a bad allowed_token_ids, bad_words) fails here, not in a replica.
        self._token_constraint(params, prompt_ids)
        if lora_request is not None and lora_request not in self._loras:
            self.add_lora(lora_request)  # checked by every replica here, so a replica's add cannot fail on it
        room = self.model_config.max_model_len - len(prompt_ids)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        index = self._pick_replica()
        arrival = time.monotonic() if arrival_time is None else arrival_time  # monotonic: one clock for all processes
        tokenized = {"prompt": text, "prompt_token_ids": prompt_ids}  # the replica need not tokenize again
        self.replicas[index].send(("add", request_id, tokenized, params, arrival, lora_request))
        self.replicas[index].adds_sent += 1
        self._placements[request_id] = _Placement(index, len(prompt_ids) + max_new * params.n, text, prompt_ids)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter in every replica (each keeps its own slots and host cache)."""
        self.collective_rpc(_rpc_add_lora, lora_request)
        self._loras.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        known = any(self.collective_rpc(_rpc_remove_lora, lora_int_id))
        self._loras = {r for r in self._loras if r.lora_int_id != lora_int_id}
        return known

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self._loras}

    def abort_request(self, request_ids: Union[str, list[str]]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self._placements:
                by_replica.setdefault(self._placements[rid].replica, []).append(rid)
        seqs = []
        for index, rids in sorted(by_replica.items()):
            seqs.append(next(self._seq))
            self.replicas[index].send(("abort", seqs[-1], rids))
        outputs = [self._restore(out) for seq in seqs for out in self._reply(seq)]
        # A replica's earlier outputs of these requests arrived before its answer: the abort outputs replace them.
        # (A request that had finished before the abort reached it keeps its own final output.)
        aborted = {out.request_id for out in outputs}
        self._outputs = [out for out in self._outputs if out.request_id not in aborted]
        for rids in by_replica.values():
            for rid in rids:
                self._placements.pop(rid, None)
        return outputs

    def step(self) -> list[RequestOutput]:
        waiting = not self._outputs and self._placements
        self._receive(_WAIT_S if waiting else 0.0)
        outputs, self._outputs = self._outputs, []
        for out in outputs:
            if out.finished:
                self._placements.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._placements or self._outputs)

    def get_stats(self) -> EngineStats:
        stats = [r.get_stats() for r in self.replicas]
        names = ("lora_running", "lora_waiting")  # adapter names: the union over replicas
        summed = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)
                  if f.name not in ("spec_accepted_per_pos", *names)}  # fmt: skip
        summed["spec_accepted_per_pos"] = tuple(map(sum, zip(*(s.spec_accepted_per_pos for s in stats))))
        for name in names:
            summed[name] = tuple(sorted({n for s in stats for n in getattr(s, name)}))
        summed["kv_cache_usage"] = summed["kv_cache_usage"] / len(stats)  # every replica has the same cache size
        return EngineStats(**summed)

    def info(self) -> dict[str, Any]:
        info = dict(self.replicas[0].ready["info"])
        info["data_parallel_size"] = len(self.replicas)
        info["replica_devices"] = [r.device_ids for r in self.replicas]
        info["device_kind"] = self.replicas[0].ready["device_kind"]  # the router never starts the devices itself
        return info

    def collective_rpc(self, fn: Callable, *args: Any) -> list[Any]:
        """``fn(engine, *args)`` in every replica's process (for tests and tools); their results in replica order.
        ``fn`` travels by name: it must be a module-level function the replicas can import. Like every method
        here, call it from the thread that drives the engine (or while nothing else uses it)."""
        seqs = []
        for replica in self.replicas:
            seqs.append(next(self._seq))
            replica.send(("rpc", seqs[-1], fn, args))
        results = [self._reply(seq) for seq in seqs]
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def close(self) -> None:
        """Stop the replicas' processes (also done when the engine is garbage-collected or Python exits)."""
        self._close()

    # ------------------------------------------------------------------ messages from the replicas

    def _receive(self, timeout: float) -> None:
        """Take in every message that has arrived, waiting up to ``timeout`` for the first."""
        by_conn = {r.conn: r for r in self.replicas}
        for conn in wait(list(by_conn), timeout):
            replica = by_conn[conn]
            for msg in replica.receive_all():
                kind = msg[0]
                if kind == "out":
                    self._outputs.extend(self._restore(out) for out in msg[1])
                    replica.take_stats(*msg[2:])
                elif kind == "aborted":
                    self._replies[msg[1]] = msg[2]
                    replica.take_stats(*msg[3:])
                elif kind == "rpc_done":
                    self._replies[msg[1]] = msg[2]

    def _reply(self, seq: int) -> Any:
        while seq not in self._replies:
            self._receive(_WAIT_S)
        return self._replies.pop(seq)

    def _restore(self, out: RequestOutput) -> RequestOutput:
        placement = self._placements.get(out.request_id)
        if placement is not None:
            out.prompt, out.prompt_token_ids = placement.prompt, placement.prompt_token_ids
        return out


def _rpc_add_lora(engine, lora_request: LoRARequest) -> bool:
    return engine.add_lora(lora_request)


def _rpc_remove_lora(engine, lora_int_id: int) -> bool:
    return engine.remove_lora(lora_int_id)


def _wait_ready(replicas: list[EngineCoreClient], release_after_first: bool) -> None:
    """Wait until every replica has built its engine (they load in parallel). ``release_after_first``: the
    others wait to compile until replica 0 is ready, and are sent "warmup" then."""
    pending = {r.conn: r for r in replicas}
    while pending:
        for conn in wait(list(pending)):
            replica = pending[conn]
            try:
                messages = replica.receive_all()
            except EngineCoreError as e:
                if isinstance(e.__cause__, ValueError):  # a bad setting: the same error as one engine would raise
                    raise e.__cause__ from None
                raise
            for msg in messages:
                if msg[0] == "ready":
                    replica.ready = msg[1]
                    replica.take_stats(msg[1]["stats"], 0)
                    pending.pop(conn)
                    logger.info("data-parallel replica %d ready (pid %d, devices %s)", replica.index,
                                msg[1]["pid"], msg[1]["devices"])
                    if release_after_first and replica.index == 0:  # its executables are in the cache now
                        for other in replicas[1:]:
                            other.send(("warmup",))


def _close_all(replicas: list[EngineCoreClient]) -> None:
    for replica in replicas:
        replica.close()
