"""DPEngine: data parallelism as independent engine replicas behind a least-loaded router.

Each replica is a whole LLMEngine (its own scheduler, KV cache and weights) on its own row of the
global ``(data, model)`` mesh, i.e. its own tensor-parallel group. Replicas never talk to each other:
a request lives on one replica from admission to finish, so no collective crosses replicas and a
replica's KV cache only ever holds its own requests.

DPEngine has LLMEngine's interface (add_request / step / abort_request / has_unfinished_requests /
get_stats / info, plus tokenizer, model_config and the prompt checks), so ``LLM``, the async engine
and the HTTP server run on it unchanged.

Stepping: ``step()`` steps every replica that has work in a small thread pool, one thread per
replica. A replica's step spends most of its time inside XLA (which releases the GIL) and in the
device-to-host copy of the sampled tokens, so on GPUs the replicas' steps overlap; only the host-side
scheduling runs one replica at a time. Outputs are returned in replica order, so results do not depend
on thread timing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any, Optional, Union

from jaxserve.config import EngineArgs
from jaxserve.llm_engine import EngineStats, LLMEngine, PromptType
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class _Placement:
    replica: int
    tokens: int  # prompt tokens + tokens it may still generate: the router's estimate of its work


class DPEngine:
    """``data_parallel_size`` LLMEngine replicas; each request goes to the least-loaded one."""

    def __init__(self, replicas: list[LLMEngine]) -> None:
        if not replicas:
            raise ValueError("DPEngine needs at least one replica")
        self.replicas = replicas
        first = replicas[0]
        self.args = first.args
        self.model_config = first.model_config
        self.scheduler_config = first.scheduler_config
        self.text_config = first.text_config
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.runner = first.runner  # for callers that only read sizes (block size, buckets)
        self._placements: dict[str, _Placement] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(len(replicas), thread_name_prefix="jaxserve-dp")

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: bool = True) -> "DPEngine":
        from jaxserve import sharding
        from jaxserve.engine_setup import build_engine_components

        args.validate()
        meshes = sharding.replica_meshes(sharding.make_mesh(args.tensor_parallel_size, args.data_parallel_size))
        replicas = []
        for i, mesh in enumerate(meshes):
            logger.info("building data-parallel replica %d/%d on devices %s", i + 1, len(meshes),
                        [d.id for d in mesh.devices.flat])
            engine = LLMEngine(build_engine_components(args, progress=progress, mesh=mesh))
            # Unseeded requests draw their seeds from the engine's RNG: give replicas different streams.
            engine._rng.seed(args.seed * 1_000_003 + i)
            replicas.append(engine)
        return cls(replicas)

    # ------------------------------------------------------------------ routing

    def replica_load(self, index: int) -> tuple[int, int]:
        """(unfinished requests, their estimated tokens) on replica ``index``; the router picks the smallest."""
        placed = [p for p in self._placements.values() if p.replica == index]
        return len(placed), sum(p.tokens for p in placed)

    def _pick_replica(self) -> int:
        return min(range(len(self.replicas)), key=lambda i: (*self.replica_load(i), i))

    # ------------------------------------------------------------------ LLMEngine's interface

    def tokenize_prompt(self, prompt: PromptType):
        return self.replicas[0].tokenize_prompt(prompt)

    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.replicas[0].validate_prompt(prompt_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
    ) -> None:
        if request_id in self._placements:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, prompt_ids = self.tokenize_prompt(prompt)
        room = self.model_config.max_model_len - len(prompt_ids)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        index = self._pick_replica()
        tokenized = {"prompt": text, "prompt_token_ids": prompt_ids}  # the replica need not tokenize again
        self.replicas[index].add_request(request_id, tokenized, params, arrival_time)  # raises before we record it
        self._placements[request_id] = _Placement(index, len(prompt_ids) + max_new * params.n)

    def abort_request(self, request_ids: Union[str, list[str]]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            placement = self._placements.pop(rid, None)
            if placement is not None:
                by_replica.setdefault(placement.replica, []).append(rid)
        outputs = []
        for index, rids in sorted(by_replica.items()):
            outputs.extend(self.replicas[index].abort_request(rids))
        return outputs

    def step(self) -> list[RequestOutput]:
        active = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(active) <= 1:
            results = [r.step() for r in active]
        else:
            results = list(self._pool.map(LLMEngine.step, active))
        outputs = [out for result in results for out in result]
        for out in outputs:
            if out.finished:
                self._placements.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def get_stats(self) -> EngineStats:
        stats = [r.get_stats() for r in self.replicas]
        summed = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)}
        summed["kv_cache_usage"] = summed["kv_cache_usage"] / len(stats)  # every replica has the same cache size
        return EngineStats(**summed)

    def info(self) -> dict[str, Any]:
        info = self.replicas[0].info()
        info["data_parallel_size"] = len(self.replicas)
        info["replica_devices"] = [[d.id for d in r.runner.mesh.devices.flat] for r in self.replicas]
        return info

    def close(self) -> None:
        self._pool.shutdown(wait=False)
