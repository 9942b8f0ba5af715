"""Servers over tiny checkpoints for the server tests, and the official `openai` client pointed at one."""

from __future__ import annotations

from typing import Iterator

import openai
import pytest
from engine_fixtures import run_cache_dir

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.server.testing import ServerThread


def serve_tiny(path, *, server_kw=None, **engine_kw) -> Iterator[ServerThread]:
    """A server named "tiny" over the checkpoint at ``path`` (float32, 128 tokens of context, a 64-token budget),
    reading hermes tool calls; ``engine_kw`` override the engine's options. Use with ``yield from`` in a fixture."""
    kw = dict(
        model=str(path), served_model_name="tiny", dtype="float32", max_model_len=128, max_num_batched_tokens=64,
        max_num_seqs=32, block_size=8, compilation_cache_dir=run_cache_dir(),
    )
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(**{**kw, **engine_kw}), progress=False)
    with ServerThread(engine, **{"tool_call_parser": "hermes", **(server_kw or {})}) as srv:
        yield srv


def serve_thinking(tmp_path_factory) -> Iterator[ServerThread]:
    """A server over a tiny reasoning model (tiny_models.make_think_checkpoint) with --reasoning-parser qwen3 and
    --structured-outputs-in-reasoning, so that a grammar can write its <think> blocks."""
    from tiny_models import make_think_checkpoint

    path = make_think_checkpoint(tmp_path_factory.mktemp("think") / "model")
    yield from serve_tiny(path, max_num_seqs=8, reasoning_parser="qwen3", structured_outputs_in_reasoning=True)


def openai_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# Module fixtures "server" and "client" over serve_thinking: a test module imports both to use them.
@pytest.fixture(scope="module", name="server")
def thinking_server(tmp_path_factory):
    yield from serve_thinking(tmp_path_factory)


@pytest.fixture(scope="module", name="client")
def thinking_client(server):
    return openai_client(server)
