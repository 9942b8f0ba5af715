"""One data-parallel replica's engine core, in a process of its own (the child side of jaxserve.dp_engine).

Why a process: a replica's host work (scheduling, batch building, dispatching the jitted step, output
processing) is Python and holds the GIL; replicas sharing one interpreter take turns at it, and two
H200s gave 1.27x one. In its own interpreter each replica's host work runs in parallel with the others'.

Started by ``replica_client.EngineCoreClient`` as ``python -m jaxserve.engine_core_proc CMD_FD OUT_FD``
with its environment already set, so the devices it may use (CUDA_VISIBLE_DEVICES, the CPU device count)
and its CPU cores are fixed before JAX is imported. It talks to the router over two pipes of pickled
tuples:

router -> core                                  core -> router
("init", dict)           first message          ("ready", dict)  configs, tokenizer (replica 0), info, stats
("warmup",)              replica 0 is ready:    (replicas > 0 with the compilation cache on wait for it
                         compile now            after loading, so they read replica 0's executables)
("add", id, prompt, params, arrival, lora)      ("out", outputs, stats, adds) after every step
("abort", seq, ids)                             ("aborted", seq, outputs, stats, adds)
("rpc", seq, fn, args)   fn(engine, *args)      ("rpc_done", seq, result or exception)
("stop",)                                       ("error", exception or None, traceback text), then exit

``adds`` counts the adds taken in so far: the router counts requests sent but not yet seen as waiting.
The core runs on its own: it steps while it has work and reads commands between steps, so it never waits
for the router. Outputs travel without their prompt (the router keeps it): a cumulative output would
otherwise resend the whole prompt every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

logger = logging.getLogger("jaxserve")


class Sender:
    """Pickles on the caller's thread and writes on its own, so that the caller never blocks on a full pipe:
    two processes that each block writing to the other while neither reads would deadlock."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        self._queue.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:  # the reader has gone; whoever reads our other pipe will notice
                return

    def close(self, timeout: float = 10.0) -> None:
        """Flush what was sent, then close the pipe."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._conn.close()


def receive(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


def _slim(outputs: list) -> list:
    return [dataclasses.replace(o, prompt=None, prompt_token_ids=None) for o in outputs]


def _picklable(error: BaseException) -> Optional[BaseException]:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text only
        return None


# ---------------------------------------------------------------- the core


def build_engine(init: dict[str, Any], commands: Optional[Connection] = None):
    """The replica's LLMEngine on all the devices this process sees (its tensor-parallel group).

    With ``init["wait_for_warmup"]`` the replica loads its weights at once but compiles only after the
    router's "warmup" command (read from ``commands``), sent when replica 0 is ready: every replica's
    processes number their devices from 0, so replica 0's entries in the persistent compilation cache are
    the very executables the others need, and DP=N compiles once instead of N times at once.
    """
    from jaxserve import sharding
    from jaxserve.engine_setup import build_engine_components
    from jaxserve.llm_engine import LLMEngine

    args, index = init["args"], init["index"]
    mesh = sharding.replica_meshes(sharding.make_mesh(args.tensor_parallel_size, 1))[0]
    before_warmup = None
    if init.get("wait_for_warmup"):
        before_warmup = lambda: _wait_for_warmup(commands, index)  # noqa: E731
    engine = LLMEngine(
        build_engine_components(args, progress=init["progress"], mesh=mesh, before_warmup=before_warmup)
    )
    # Unseeded requests draw their seeds from the engine's RNG: give replicas different streams.
    engine._rng.seed(args.seed * 1_000_003 + index)
    return engine


def _wait_for_warmup(commands: Connection, index: int) -> None:
    logger.info("replica %d loaded; waiting for replica 0 to fill the compilation cache", index)
    kind = receive(commands)[0]
    if kind == "stop":  # the router gave up (replica 0 failed): leave quietly, as on EOF
        raise EOFError
    if kind != "warmup":
        raise ValueError(f"unexpected command {kind!r} from the router before warm-up")


def ready_message(engine, init: dict[str, Any]) -> tuple:
    import jax

    return ("ready", {
        "model_config": engine.model_config,
        "scheduler_config": engine.scheduler_config,
        "text_config": engine.text_config,
        "eos_token_ids": engine.eos_token_ids,
        "tokenizer": engine.tokenizer if init["send_tokenizer"] else None,
        "info": engine.info(),
        "stats": engine.get_stats(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "pid": os.getpid(),
    })


def serve(engine, commands: Connection, sender: Sender) -> None:
    """Step while there is work; between steps, run every command that has arrived. Returns on "stop"."""
    adds = 0
    while True:
        if not engine.has_unfinished_requests():
            wait([commands])  # idle: sleep until a command (or the router's end: EOF) arrives
        while commands.poll():
            msg = receive(commands)
            kind = msg[0]
            if kind == "add":
                engine.add_request(*msg[1:])
                adds += 1
            elif kind == "abort":
                outputs = engine.abort_request(msg[2])
                sender.send(("aborted", msg[1], _slim(outputs), engine.get_stats(), adds))
            elif kind == "rpc":
                _, seq, fn, args = msg
                try:
                    result = fn(engine, *args)
                except Exception as e:  # noqa: BLE001 - the caller's function failed, not the engine
                    result = _picklable(e) or RuntimeError(f"{fn.__name__} failed:\n{traceback.format_exc()}")
                sender.send(("rpc_done", seq, result))
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown command {kind!r} from the router")
        if engine.has_unfinished_requests():
            outputs = engine.step()
            sender.send(("out", _slim(outputs), engine.get_stats(), adds))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="a jaxserve data-parallel engine core (started by DPEngine)")
    p.add_argument("cmd_fd", type=int)
    p.add_argument("out_fd", type=int)
    p.add_argument("--cpus", default="", help="comma-separated CPU cores to run on (set before JAX starts)")
    ns = p.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group: the router alone decides when a core stops
    # (a "stop" command, or the end of its pipe when the router exits).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if ns.cpus:
        os.sched_setaffinity(0, [int(c) for c in ns.cpus.split(",")])
    commands = Connection(ns.cmd_fd, writable=False)
    sender = Sender(Connection(ns.out_fd, readable=False), "jaxserve-core-sender")
    try:
        kind, init = receive(commands)
        assert kind == "init", kind
        # The router's import path, so that rpc functions from its modules (tests, tools) resolve here.
        sys.path.extend(path for path in init["sys_path"] if path not in sys.path)
        logging.basicConfig(
            level=init["log_level"],
            format=f"%(levelname)s %(asctime)s [replica {init['index']}] %(name)s: %(message)s",
        )
        engine = build_engine(init, commands)
        sender.send(ready_message(engine, init))
        serve(engine, commands, sender)
    except (EOFError, BrokenPipeError):
        return 0  # the router went away: nobody is left to report to
    except BaseException as e:  # noqa: BLE001 - every failure must reach the router, not just die here
        sender.send(("error", _picklable(e), traceback.format_exc()))
        return 1
    finally:
        sender.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
