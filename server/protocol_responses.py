"""Response bodies of the OpenAI API, as pydantic models (also the source of /openapi.json)."""

from __future__ import annotations

import importlib.metadata
import time
import uuid
from typing import Literal, Optional

from pydantic import BaseModel, Field


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def server_version() -> str:
    """The installed jaxserve's version (from its metadata, so a stray `jaxserve/` folder on sys.path can't hide it)."""
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree without installing
        from jaxserve import __version__

        return __version__


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None  # under --enable-prompt-tokens-details


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------- completions


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's extra ``prompt_logprobs``: one alternative at one prompt position."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per prompt token: None for the first, then {token id: PromptLogprob} (the prompt token and its top alternatives).
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None  # vLLM's extra: the stop string or token id that ended it
    prompt_logprobs: Optional[PromptLogprobs] = None  # vLLM's extra, with "prompt_logprobs" in the request


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


# ---------------------------------------------------------------- chat


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    # A reasoning model's <think> block (--reasoning-parser): vLLM's "reasoning", and its older name too.
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobs] = None  # vLLM's extra, with "prompt_logprobs" in the request


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None  # in the call's first delta
    arguments: str = ""  # the arguments' new text


class DeltaToolCall(BaseModel):
    index: int  # which call of the choice: deltas with the same index join into one call
    id: Optional[str] = None  # in the call's first delta
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    reasoning: Optional[str] = None  # as ChatResponseMessage's
    reasoning_content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


# ---------------------------------------------------------------- models, tokenizer


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
