"""DP=N compiles once: replicas > 0 load their weights at once but compile only after replica 0 is ready,
so they read its executables from the persistent compilation cache instead of compiling them again."""

from __future__ import annotations

import logging
import re
from multiprocessing import Pipe

import pytest
from engine_fixtures import checkpoint

from jaxserve import LLM, SamplingParams
from jaxserve.dp_engine import _wait_ready
from jaxserve.engine_core_proc import _wait_for_warmup


class FakeReplica:
    """A replica's router side whose core answers "warmup" at once with "ready" (cores that do not wait
    start with "ready" queued)."""

    def __init__(self, index: int, waits: bool):
        self.index, self.ready, self.sent = index, None, []
        self.conn, self._core = Pipe(duplex=False)
        if not waits:
            self._ready()

    def _ready(self):
        self._core.send(("ready", {"stats": None, "pid": 100 + self.index, "devices": []}))

    def send(self, message):
        self.sent.append(message)
        if message == ("warmup",):
            self._ready()

    def receive_all(self):
        messages = []
        while self.conn.poll():
            messages.append(self.conn.recv())
        return messages

    def take_stats(self, stats, adds):
        pass


def test_router_releases_the_others_when_replica_0_is_ready():
    replicas = [FakeReplica(0, waits=False), FakeReplica(1, waits=True), FakeReplica(2, waits=True)]
    _wait_ready(replicas, release_after_first=True)  # would block forever if 1 and 2 were never released
    assert [r.sent for r in replicas] == [[], [("warmup",)], [("warmup",)]]
    assert all(r.ready is not None for r in replicas)


def test_without_the_cache_nobody_waits_or_is_told_to():
    replicas = [FakeReplica(i, waits=False) for i in range(3)]
    _wait_ready(replicas, release_after_first=False)
    assert [r.sent for r in replicas] == [[], [], []]


def test_waiting_core_leaves_quietly_when_the_router_stops_it():
    router, core = Pipe()
    router.send(("stop",))
    with pytest.raises(EOFError):  # main() treats EOF as "the router went away": exit 0, no error report
        _wait_for_warmup(core, 1)
    router.send(("warmup",))
    _wait_for_warmup(core, 1)


def test_replica_1_reads_replica_0s_executables(tmp_path, capfd, caplog, monkeypatch):
    """End to end on the CPU, with the cache on: every executable replica 0 wrote to the cache is a hit in
    replica 1, never compiled and written again (before this ordering both compiled every step at once)."""
    monkeypatch.setenv("JAX_DEBUG_LOG_MODULES", "jax._src.compiler,jax._src.compilation_cache")  # replicas inherit
    caplog.set_level(logging.INFO, logger="jaxserve")  # replicas log at the router's level
    llm = LLM(
        checkpoint("llama_gqa"), data_parallel_size=2, dtype="float32", max_model_len=16, max_num_batched_tokens=8,
        max_num_seqs=1, block_size=4, compilation_cache_dir=str(tmp_path), use_tqdm_on_load=False,
    )  # fmt: skip
    try:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.close()
    log = capfd.readouterr().err

    def keys(replica: int, what: str) -> set[str]:
        return set(re.findall(rf"\[replica {replica}\] .*{what}.* with key '([^']+)'", log))

    written0, written1, hits1 = keys(0, "Writing"), keys(1, "Writing"), keys(1, "cache hit")
    assert "replica 1 loaded; waiting for replica 0" in log
    # jax caches only what took >= 0.5 s to compile (jaxserve's threshold); on this tiny model that is the
    # step executables on a slow CPU, and maybe nothing on a fast one: then there is nothing to share.
    assert written0 <= hits1 and not written0 & written1, (written0, written1, hits1)
