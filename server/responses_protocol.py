"""POST /v1/responses (OpenAI's Responses API): its request body, and the chat request it is served as.

A Responses request is a chat request in other clothes: ``input`` (a string, or items: messages, the model's
earlier function calls and their outputs) and ``instructions`` become chat messages, function ``tools`` and
``tool_choice`` the chat's, ``text.format`` the chat's response_format, ``max_output_tokens`` its token limit.
Everything after that (the chat template, tool plans, structured outputs, reasoning) is the chat route's.
The sampling extras of the other endpoints (seed, stop, top_k, structured_outputs, ...) are accepted too.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import Field

from jaxserve.server.errors import bad_request
from jaxserve.server.protocol import (
    ChatCompletionRequest, ChatMessage, FunctionCallIn, FunctionDefinition, ImageURLPart, JsonSchemaFormat,
    NamedFunction, NamedToolChoice, ResponseFormat, TextPart, Tool, ToolCallIn, _Request, _SamplingFields,
)


class InputText(_Request):
    type: Literal["input_text", "output_text"]  # output_text: an assistant turn sent back
    text: str


class InputImage(_Request):
    type: Literal["input_image"]
    image_url: Optional[str] = None  # a data: URL, or a local file under --allowed-local-media-path
    detail: Optional[str] = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Union[InputText, InputImage]]]


class FunctionCallItem(_Request):
    """A call the model made earlier (sent back beside its output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Request):
    """An earlier reply's reasoning, sent back: chat templates drop it, and so does this server."""

    type: Literal["reasoning"]


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class FunctionTool(_Request):
    """A function, in the Responses API's flat form (the chat API nests it under "function")."""

    type: str = "function"
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Request):
    format: Optional[TextFormat] = None


LOGPROBS = "message.output_text.logprobs"
# OpenAI's values of ``include``: the others concern its hosted tools and encrypted reasoning.
INCLUDABLE = frozenset({
    LOGPROBS, "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
    "reasoning.encrypted_content",
})


class ResponsesRequest(_SamplingFields):
    """POST /v1/responses."""

    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice]] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    store: bool = True  # kept in this server's memory for previous_response_id and GET /v1/responses/{id}
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    truncation: Optional[Literal["disabled"]] = None  # "auto" (drop old turns to fit) is not offered
    # "message.output_text.logprobs": each answer token's logprob beside the text, with top_logprobs alternatives.
    # OpenAI's other values name tools this server does not have: accepted, and nothing to add.
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    # vLLM's extras, as on chat.
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @property
    def logprobs(self) -> Optional[int]:
        """How many alternatives each answer token's logprob comes with (None: no logprobs); a 400 naming an
        ``include`` value OpenAI does not define."""
        unknown = sorted(set(self.include or ()) - INCLUDABLE)
        if unknown:
            raise bad_request(f"include={unknown} is invalid: the values are {sorted(INCLUDABLE)} (this server adds "
                              "only message.output_text.logprobs)", param="include")
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or ()) else None

    def messages(self) -> list[dict[str, Any]]:
        """This request's own turns as chat messages (instructions first); a 400 naming the field when an item cannot
        be one."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            if not self.input:
                raise bad_request("input must not be empty", param="input")
            return out + [{"role": "user", "content": self.input}]
        if not self.input:
            raise bad_request("input must not be an empty list", param="input")
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": _content(item.content)})
            elif isinstance(item, FunctionCallItem):
                try:
                    call = ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments))
                except ValueError as e:
                    raise bad_request(f"input: the function_call {item.call_id!r} has bad arguments ({e})",
                                      param="input") from None
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":  # one turn: its text and all its calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def as_chat(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request that serves this one, after ``history`` (a stored response's whole conversation)."""
        if self.n != 1:
            raise bad_request(f"n={self.n} is invalid: a response has one output; send several requests", param="n")
        fields = {k: getattr(self, k) for k in _SamplingFields.model_fields if k not in ("response_format", "stream_options")}
        # The instructions come first; a stored conversation never holds an earlier turn's (they are not carried
        # over to the next response, as in OpenAI's API).
        mine = [ChatMessage(**m) for m in self.messages()]
        messages = mine[:1] + list(history) + mine[1:] if self.instructions else list(history) + mine
        return ChatCompletionRequest(
            **fields, messages=messages, max_completion_tokens=self.max_output_tokens, tools=self._chat_tools(),
            tool_choice=self._chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(), chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
        )

    def _chat_tools(self) -> Optional[list[Tool]]:
        if not self.tools:
            return None
        tools = []
        for i, t in enumerate(self.tools):
            if t.type != "function":
                raise bad_request(f"tools[{i}].type={t.type!r} is invalid: this server runs function tools only "
                                  "(type \"function\" with a name and a parameters schema)", param=f"tools[{i}].type")
            if not t.name:
                raise bad_request(f"tools[{i}].name is missing: every function needs a name", param=f"tools[{i}].name")
            tools.append(Tool(function=FunctionDefinition(name=t.name, description=t.description,
                                                          parameters=t.parameters, strict=t.strict)))
        return tools

    def _chat_tool_choice(self):
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return NamedToolChoice(function=NamedFunction(name=choice.name))
        return choice

    def _response_format(self) -> Optional[ResponseFormat]:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.json_schema is None:
            raise bad_request("text.format.schema is missing: a json_schema format needs the schema itself",
                              param="text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=fmt.name, schema=fmt.json_schema))


def _content(content) -> Union[str, list]:
    if isinstance(content, str):
        return content
    parts: list = []
    for p in content:
        if isinstance(p, InputImage):
            if not p.image_url:
                raise bad_request("input: an input_image needs image_url (a data: URL or a local file); file_id is "
                                  "not offered", param="input")
            parts.append(ImageURLPart(type="image_url", image_url=p.image_url))
        else:
            parts.append(TextPart(type="text", text=p.text))
    return parts


def tool_choice_json(choice) -> Union[str, dict[str, Any]]:
    """tool_choice as a response echoes it."""
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def tools_json(tools: Optional[list[FunctionTool]]) -> list[dict[str, Any]]:
    return [json.loads(t.model_dump_json(exclude_none=True)) for t in tools or []]
