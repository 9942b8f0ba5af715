"""What the completion and chat routes share: the server's state, model names, prompt checks, submission."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

import pydantic
from starlette.requests import Request

from jaxserve.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from jaxserve.lora.request import LoRARequest
from jaxserve.reasoning import ReasoningFormat, prompt_state_of_ids, reasoning_tags
from jaxserve.sampling_params import SamplingParams

from jaxserve.server.deltas import Delta, DeltaTracker, final_outputs, stream_outputs
from jaxserve.server.errors import APIError, bad_request, error_body, from_validation_error, from_value_error
from jaxserve.server.protocol_responses import PromptTokensDetails, UsageInfo, now_s
from jaxserve.server.responses_output import ResponseStore
from jaxserve.server.sse import DONE, cancel_on_disconnect

logger = logging.getLogger("jaxserve.server")

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclasses.dataclass
class ServerState:
    """Everything a route needs; one per app, stored on ``app.state.jaxserve``."""

    engine: AsyncLLMEngine
    # The server's own copy of the tokenizer: the engine thread detokenizes with the engine's copy at
    # the same time, and a Hugging Face fast tokenizer is not safe to share across threads.
    tokenizer: Any
    served_model_names: list[str]
    model_root: str
    max_model_len: int
    api_key: Optional[str] = None
    log_requests: bool = True
    # Vision-language models: the engine's image processor (None for text models), and where image_url parts
    # may name local files (None: nowhere).
    mm_processor: Any = None
    allowed_local_media_path: Optional[str] = None
    created: int = dataclasses.field(default_factory=now_s)
    # LoRA adapters served under their own model names (--lora-modules, or loaded at run time), by name.
    lora_modules: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    next_lora_id: int = 1
    tool_call_parser: Optional[str] = None  # tool_choice="auto" reads calls in this format (None: refused)
    reasoning: Optional[ReasoningFormat] = None  # a reasoning model's format (--reasoning-parser): chat splits replies
    reasoning_start_id: Optional[int] = None  # its <think> token
    reasoning_end_id: Optional[int] = None  # its </think> token
    default_chat_template_kwargs: dict = dataclasses.field(default_factory=dict)  # under each request's own
    enable_prompt_tokens_details: bool = False  # usage carries prompt_tokens_details.cached_tokens
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)  # /v1/responses kept for the next turn

    @classmethod
    def for_engine(cls, engine: AsyncLLMEngine, api_key: Optional[str] = None, **kw) -> "ServerState":
        core = engine.engine
        names = [core.model_config.served_model_name]
        tokenizer = copy.deepcopy(core.tokenizer) if core.tokenizer is not None else None
        tags = reasoning_tags(getattr(getattr(core, "args", None), "reasoning_parser", None), tokenizer)
        return cls(
            engine=engine,
            tokenizer=tokenizer,
            served_model_names=names,
            model_root=core.model_config.model,
            max_model_len=core.model_config.max_model_len,
            api_key=api_key,
            mm_processor=getattr(core, "mm_processor", None),
            allowed_local_media_path=getattr(getattr(core, "args", None), "allowed_local_media_path", None),
            reasoning=tags[0] if tags else None,
            reasoning_start_id=tags[1] if tags else None,
            reasoning_end_id=tags[2] if tags else None,
            **kw,
        )

    def reasoning_state(self, prompt_ids: list[int]) -> Optional[str]:
        """Where a chat reply to ``prompt_ids`` starts (jaxserve.reasoning.prompt_state); None without a parser."""
        if self.reasoning is None or self.tokenizer is None:
            return None
        return prompt_state_of_ids(self.reasoning, self.tokenizer, prompt_ids)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, name: Optional[str]) -> str:
        """The served name for ``name`` (None: the default; an adapter's name for a LoRA adapter); 404 for a
        model we don't serve."""
        if name is None or name in self.served_model_names:
            return self.model_name
        if name in self.lora_modules:
            return name
        served = ", ".join([*self.served_model_names, *self.lora_modules])
        raise APIError(
            404, f"The model `{name}` does not exist. This server serves: {served}", param="model", code="model_not_found"
        )

    def lora_request(self, model: str) -> Optional[LoRARequest]:
        """The adapter a resolved model name selects (None: the base model)."""
        return self.lora_modules.get(model)

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, but the server runs with --skip-tokenizer-init")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.need_tokenizer("a text prompt").encode(text, add_special_tokens=add_special_tokens))

    def check_fits(self, prompt_len: int, max_tokens: Optional[int], prompt_param: str, tokens_param: str) -> None:
        """400 with the numbers when the prompt, or prompt plus max_tokens, exceeds the context."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt is {prompt_len} tokens "
                f"long, which leaves no room to generate. Shorten the {prompt_param} to at most {limit - 1} tokens.",
                param=prompt_param,
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, {max_tokens} for the "
                f"completion). Reduce the {prompt_param} or {tokens_param} (at most {limit - prompt_len} here).",
                param=tokens_param,
            )

    async def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        model: Optional[str] = None,
        mm: Any = None,
    ) -> list[RequestStream]:
        """Add one engine request per prompt; all or none (on failure the ones added are aborted). ``model``: the
        resolved model name, which selects a LoRA adapter when it names one. ``mm``: one prompt's preprocessed
        images (jaxserve.multimodal.MultiModalInputs), its ids already expanded."""
        streams: list[RequestStream] = []
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        lora = self.lora_request(model) if model is not None else None
        lora_kw = {"lora_request": lora} if lora is not None else {}
        try:
            for rid, ids_ in zip(ids, prompts):
                prompt = {"prompt_token_ids": ids_} if mm is None else {"prompt_token_ids": ids_, "mm_inputs": mm}
                streams.append(await self.engine.add_request(rid, prompt, params, **lora_kw))
        except BaseException as e:
            self.engine.abort([s.request_id for s in streams])
            raise engine_error(e) from e
        return streams


def engine_error(e: BaseException) -> BaseException:
    """The HTTP error for an engine exception (other exceptions, e.g. cancellation, pass through)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), code="queue_full")
    if isinstance(e, EngineDeadError):
        return APIError(500, f"the engine is not running: {e}", code="engine_dead")
    return e


def usage(tracker: DeltaTracker) -> UsageInfo:
    """A response's usage so far; with the tracker's ``prompt_details``, the prompt's cached tokens too."""
    prompt, completion = tracker.num_prompt_tokens, tracker.completion_tokens
    details = PromptTokensDetails(cached_tokens=tracker.cached_tokens) if tracker.prompt_details else None
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)


async def stream_choices(
    streams: list[RequestStream],
    tracker: DeltaTracker,
    body,
    make_choice: Callable[[int, Delta, Any], Any],  # (prompt index, delta, its RequestOutput) -> a chunk choice
    chunk: Callable[[list, Optional[UsageInfo]], bytes],  # (choices, usage or None) -> one SSE event
) -> AsyncIterator[bytes]:
    """What every streamed endpoint sends after its opening: one chunk per engine output that moved a
    choice (with running usage under continuous_usage_stats), the usage chunk under include_usage, [DONE]."""
    async for i, out in stream_outputs(streams):
        choices = [make_choice(i, d, out) for d in tracker.update(i, out)]
        if choices:
            running = usage(tracker) if body.continuous_usage else None
            yield chunk(choices, running)
    if body.include_usage:
        yield chunk([], usage(tracker))
    yield DONE



def abort_unfinished(engine: AsyncLLMEngine, streams: list[RequestStream]) -> None:
    """Free the engine's work for a response that ends early (client gone, error, shutdown)."""
    ids = [s.request_id for s in streams if not s.finished]
    if ids:
        engine.abort(ids)


async def collect_finals(request: Request, engine: AsyncLLMEngine, streams: list[RequestStream]) -> list:
    """Every stream's final output (a non-streaming response). A client that goes away cancels the wait; an
    engine failure becomes its API error; whatever did not finish is aborted, so its work is freed."""
    try:
        return await cancel_on_disconnect(request, final_outputs(streams))
    except Exception as e:
        raise engine_error(e) from e
    finally:
        abort_unfinished(engine, streams)


def get_state(request: Request) -> ServerState:
    return request.app.state.jaxserve


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as ``model``; 400 naming the problem for bad JSON or a bad field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from None


async def guard_stream(
    events: AsyncIterator[bytes], *, what: str, request_id: str, engine: AsyncLLMEngine, streams: list[RequestStream]
) -> AsyncIterator[bytes]:
    """Relay a route's SSE events. The status line is already sent, so an engine error mid-stream becomes
    an in-band OpenAI error event (as OpenAI does); unfinished requests are aborted however the stream
    ends, a client disconnect included."""
    from jaxserve.server.sse import DONE, cancel_on_disconnect, sse_event

    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - reported in-band, see above
        err = engine_error(e)
        logger.warning("%s stream %s failed: %r", what, request_id, e)
        status = getattr(err, "status", 500)
        yield sse_event(error_body(status, getattr(err, "message", str(e)), code=getattr(err, "code", None)))
        yield DONE
    finally:
        abort_unfinished(engine, streams)
