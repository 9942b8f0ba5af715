"""Request bodies of the OpenAI API (and vLLM's extras), as pydantic models, and their SamplingParams.

Unknown fields are ignored (as vLLM does), so clients that send newer OpenAI fields keep working;
known fields are checked here and again by SamplingParams, whose ValueError names the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

from jaxserve.server.tool_calls import forced_call_schema

_MAX_STOP = 16  # OpenAI allows 4; vLLM allows any. Bound it so one request cannot slow every step.


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM: usage in every chunk


class _SamplingFields(_Request):
    """Fields shared by completions and chat, with OpenAI's defaults."""

    model: Optional[str] = None  # None: the served model
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)  # None: 1.0
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    user: Optional[str] = None
    # vLLM's extras.
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # each prompt token's, + this many top
    logit_bias: Optional[dict[str, float]] = None  # OpenAI's: {"token id": bias in [-100, 100]}
    allowed_token_ids: Optional[list[int]] = None  # only these tokens may be sampled
    bad_words: Optional[list[str]] = None  # words the output may not contain
    # Structured outputs, three spellings: OpenAI's response_format (json_object, json_schema), vLLM's
    # structured_outputs {json | regex | choice | grammar | json_object} and its older guided_* fields.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None:
            if len(stops) > _MAX_STOP:
                raise ValueError(f"at most {_MAX_STOP} stop strings are allowed, got {len(stops)}")
            if any(not s for s in stops):
                raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v):
        if v is not None and v < -1:
            raise ValueError("top_k must be >= 1, or 0 / -1 to disable")
        return v

    def sampling_params(
        self, max_tokens: Optional[int], logprobs: Optional[int], prompt_logprobs: Optional[int] = None
    ) -> SamplingParams:
        """SamplingParams for this request; ValueError (naming the field) if they are inconsistent.
        ``prompt_logprobs``: the engine's, where the endpoint asks for more than the body's field (echo)."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            logit_bias=_token_bias(self.logit_bias),
            structured_outputs=self._structured_outputs(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _structured_outputs(self) -> Optional[dict[str, Any]]:
        """The one constraint the body asks for, as StructuredOutputsParams's fields; ValueError when it asks in
        more than one way."""
        asked = self._asked_constraints()
        if len(asked) > 1:
            raise ValueError(f"{next(iter(asked))}=... is invalid together with {', '.join(list(asked)[1:])}: ask "
                             "for one output constraint")
        return next(iter(asked.values()), None)

    def _asked_constraints(self) -> dict[str, dict[str, Any]]:
        """Every output constraint in the body, by the field that asks for it."""
        asked: dict[str, dict[str, Any]] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError('response_format={"type": "json_schema"} is invalid: it needs json_schema.schema, '
                                 'e.g. {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}')
            asked["response_format"] = {"json": fmt.json_schema.json_schema}
        if self.structured_outputs is not None:
            asked["structured_outputs"] = self.structured_outputs
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                asked[f"guided_{kind}"] = {kind: value}
        return asked

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _token_bias(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias has string keys (JSON objects): token ids as integers, or a ValueError naming the key."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias={{{key!r}: {value}}} is invalid: keys must be token ids, e.g. "
                             '{"1234": -100}') from None
    return out


# A prompt: text, a list of texts, token ids, or a list of token-id lists.
PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: PromptInput
    # OpenAI's default; None: up to the context; 0: with echo, the prompt alone (scored with logprobs)
    max_tokens: Optional[int] = Field(16, ge=0)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if all(isinstance(p, list) for p in v) and any(not p for p in v):
                raise ValueError("every token-id prompt must have at least one token")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    detail: Optional[str] = None  # OpenAI's "auto" | "low" | "high": accepted, not used


class ImageURLPart(_Request):
    """An image: a data: URL (base64 PNG/JPEG), or a local file under --allowed-local-media-path."""

    type: Literal["image_url"]
    image_url: Union[ImageURL, str]

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class FunctionCallIn(_Request):
    name: str
    arguments: Union[str, dict[str, Any]]  # OpenAI sends a JSON string; chat templates want the object

    @field_validator("arguments")
    @classmethod
    def _as_object(cls, v):
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"arguments must be a JSON object ({e})") from None
        if not isinstance(v, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(v).__name__}")
        return v


class ToolCallIn(_Request):
    """A call an earlier assistant turn made (sent back with the tool's result)."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[Union[TextPart, ImageURLPart]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant turn's calls
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers

    @property
    def image_urls(self) -> list[str]:
        return [p.url for p in self.content if isinstance(p, ImageURLPart)] if isinstance(self.content, list) else []

    def as_template_dict(self) -> dict[str, Any]:
        """The dict a chat template expects; text parts are joined, "developer" is OpenAI's new "system". With
        images the content stays a list of parts, each image as {"type": "image"} (vision-language templates)."""
        content = self.content
        if isinstance(content, list) and self.image_urls:
            content = [
                {"type": "image"} if isinstance(part, ImageURLPart) else {"type": "text", "text": part.text}
                for part in content
            ]
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDefinition(_Request):
    name: str = Field(..., min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object; None: no arguments
    strict: Optional[bool] = None  # forced calls always follow the schema; free-text ones are parsed as written


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def template_tools(tools: Optional[list[Tool]]) -> Optional[list[dict[str, Any]]]:
    """The tools as a chat template reads them (OpenAI's own format, which transformers' templates take)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Request):
    """OpenAI's response_format.json_schema: the schema under "schema" (a name pydantic reserves, hence the alias)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None  # every schema is enforced strictly here


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)  # deprecated by OpenAI, still widely sent
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    # vLLM's extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # continue the last (assistant) message instead of starting a new turn
    chat_template: Optional[str] = None  # a Jinja template to use instead of the model's
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more template variables, e.g. {"enable_thinking": false}
    include_reasoning: bool = True  # with --reasoning-parser: False leaves the reasoning out of the reply

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        """tool_choice with OpenAI's default: "auto" with tools, "none" without. ValueError naming the field when
        it asks for a call that the tools cannot make."""
        names = [t.function.name for t in self.tools or []]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"tools=... is invalid: two functions are named {dup!r}; give each its own name")
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if names else "none")
        if not names and choice in ("none", "auto"):
            return "none"
        if not names:
            shown = choice if isinstance(choice, str) else choice.model_dump()
            raise ValueError(f"tool_choice={json.dumps(shown)} is invalid without tools: send the functions in "
                             "tools=[{\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}]")
        if not isinstance(choice, str) and choice.function.name not in names:
            raise ValueError(f"tool_choice={json.dumps(choice.model_dump())} is invalid: tools has no function "
                             f"named {choice.function.name!r} (it has {', '.join(names)})")
        return choice

    def _asked_constraints(self) -> dict[str, dict[str, Any]]:
        asked = super()._asked_constraints()
        schema = forced_call_schema(self.tools or [], self.effective_tool_choice, self.parallel_tool_calls)
        if schema is not None:  # a forced tool choice generates under its schema, like response_format
            asked = {"tool_choice": {"json": schema}, **asked}
        return asked


class TokenizeRequest(_Request):
    """POST /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Tool]] = None  # rendered into the messages' prompt, as on chat
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: Optional[str] = None
    tokens: list[int]
