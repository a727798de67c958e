"""A Responses request made into the chat completion it runs as: the conversation (a stored
history, then this request's input items) as chat messages after `instructions`, the flat
function tools and tool_choice in chat's shapes, `text.format` as response_format and
max_output_tokens as max_tokens. The chat request is validated by the chat route's own model,
so everything after (chat template, tools in the prompt, grammars, defaults, the queue) is the
chat route's; its errors are renamed into this API's fields (`responses_error`).

Items become messages as the chat templates expect them: function calls right after an
assistant message (or each other) join that message's `tool_calls`, a call's output is a `tool`
message. `instructions` are not part of the conversation: a continued one (previous_response_id)
takes the new request's instructions only, as OpenAI's API does. A reasoning item is the
`reasoning_content` of the assistant message after it (chat templates that show past reasoning
read it there); with none after it, it is not part of the prompt.

`chat_template_kwargs` (vLLM's chat field, e.g. `{"enable_thinking": false}`) is passed on to
the chat request as sent.
"""

from __future__ import annotations

from typing import Any

from gateway.openai.errors import ApiError
from gateway.openai.generation_fields import GenerationFields
from gateway.openai.request_models import ChatCompletionRequest, parse_chat
from gateway.openai.responses_items import InputItem
from gateway.openai.responses_models import ResponsesRequest

# The sampling fields passed on as the client sent them (chat validates them alike); n and
# stream_options are chat's alone (the first refused here, the second means something else).
FORWARDED = tuple(
    name for name in GenerationFields.model_fields if name not in ("n", "stream_options")
)
# Chat's names for this API's fields, in the errors of the chat request's checks.
RENAMED = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens"}


def chat_messages(items: list[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation as chat messages, in order."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None  # a reasoning item's, for the assistant message right after
    for item in items:
        if item.type == "reasoning":
            reasoning = item.text
            continue
        if item.type == "function_call":
            call = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": call}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        else:
            messages.append({"role": item.role, "content": item.text})
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return messages


def chat_request(
    request: ResponsesRequest, body: dict[str, Any], history: list[InputItem]
) -> ChatCompletionRequest:
    """The chat request that answers `request` (whose raw body is `body`) after `history`."""
    chat: dict[str, Any] = {name: body[name] for name in FORWARDED if name in body}
    if "chat_template_kwargs" in body:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    chat["messages"] = chat_messages([*history, *request.input], request.instructions)
    chat["max_tokens"] = request.max_output_tokens
    if request.tools:
        chat["tools"] = [
            {"type": "function", "function": t.spec()["function"]} for t in request.tools
        ]
        chat["parallel_tool_calls"] = request.parallel_tool_calls
    choice = request.tool_choice
    if choice is not None:
        named = not isinstance(choice, str)
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if named else choice
        )
    if request.text_format is not None:
        chat["response_format"] = request.text_format.response_format()
    return parse_chat(chat)  # its errors: responses_error


def responses_error(error: ApiError) -> ApiError:
    """An error of the chat request's checks (or its request path), said in this API's fields:
    `response_format` is `text.format`, `messages` are `input`."""
    param = error.param or ""
    head = param.split(".")[0].split("[")[0]
    if head in RENAMED:
        error.message = error.message.replace(f"'{param}'", f"'{RENAMED[head]}'")
        error.param = RENAMED[head]
    return error
