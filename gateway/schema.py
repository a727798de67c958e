"""Request validation: a JSON body becomes a typed request, or an ApiError naming the field.

Only the shape is checked here; what needs the model (token ids in the vocabulary, prompt +
max_tokens within the context window) is checked in `gateway.generate` after tokenizing.
Unknown fields are ignored (clients send many optional OpenAI fields); known fields we cannot
honour (suffix, best_of > n, ...) are refused rather than silently ignored. Structured outputs
and tools have modules of their own (gateway.structured, gateway.tools).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gateway.errors import bad_request
from gateway.structured import Grammar, parse_grammar
from gateway.tools import ToolConfig, parse_tools
from protocol import PRIORITIES, SamplingParams
from protocol.sampling import MAX_CHOICES, MAX_LOGPROBS

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # the detokenizer holds back this much text while a stop may be forming
MAX_STOP_TOKEN_IDS = 256
MAX_MODEL_NAME_CHARS = 256
MAX_TOKEN_ID = 2**31 - 1  # vocabularies are far smaller; anything above is garbage
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
_INT64 = 2**63


@dataclass(slots=True)
class CompletionRequest:
    model: str | None
    prompt: str | list[int]  # text, or token ids (checked against the vocabulary later)
    max_tokens: int | None  # None: the route's default; 0 only with echo (the prompt alone)
    sampling: SamplingParams  # its max_tokens (and min_tokens) are set by gateway.generate
    stream: bool = False
    include_usage: bool = False
    min_tokens: int = 0  # checked against the resolved max_tokens in gateway.generate
    grammar: Grammar | None = None  # compiled against the model's tokenizer in gateway.generate
    echo: bool = False  # the prompt comes back before the completion (with its logprobs)
    priority: int | None = None  # None: the API key's default


@dataclass(slots=True)
class ChatRequest:
    model: str | None
    # role + content (text parts joined); tool results' tool_call_id, assistants' tool_calls
    messages: list[dict[str, Any]]
    max_tokens: int | None  # None: the route's default (gateway.generate resolves it)
    sampling: SamplingParams  # its max_tokens (and min_tokens) are set by gateway.generate
    stream: bool = False
    include_usage: bool = False
    min_tokens: int = 0  # checked against the resolved max_tokens in gateway.generate
    grammar: Grammar | None = None  # response_format / guided_*, or a forced tool call
    tools: ToolConfig | None = None
    priority: int | None = None  # None: the API key's default


def parse_json(raw: bytes) -> dict[str, Any]:
    def no_constants(name: str) -> Any:
        raise ValueError("NaN and Infinity are not valid JSON")

    try:
        # Strict UTF-8 (RFC 8259), not json's guess among UTF-8/16/32.
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8.", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError):  # JSONDecodeError, and ints over 4300 digits
        raise bad_request("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    _refuse_unsupported(body, _COMPLETION_UNSUPPORTED)
    stream, include_usage = _stream(body)
    logprobs = body.get("logprobs")
    if logprobs is False:  # some clients send false for "none"
        logprobs = None
    echo = _opt_bool(body, "echo")
    sampling = _sampling(body)
    best_of = _opt_int(body, "best_of")
    if best_of is not None and best_of != sampling.n:  # best_of = n: every candidate returned
        raise bad_request(
            "'best_of' must equal 'n' (no candidates are ranked and dropped).", param="best_of"
        )
    return CompletionRequest(
        model=_model(body),
        prompt=_prompt(body.get("prompt")),
        max_tokens=_opt_int(body, "max_tokens", lo=0 if echo else 1),
        sampling=replace(
            sampling, logprobs=_opt_int({"logprobs": logprobs}, "logprobs", 0, MAX_LOGPROBS)
        ),
        stream=stream,
        include_usage=include_usage,
        min_tokens=_opt_int(body, "min_tokens", lo=0) or 0,
        grammar=parse_grammar(body),
        echo=echo,
        priority=_priority(body),
    )


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    _refuse_unsupported(body, _CHAT_UNSUPPORTED)
    stream, include_usage = _stream(body)
    max_tokens = _opt_int(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", lo=1)
    logprobs = _chat_logprobs(body)
    tools = parse_tools(body)
    grammar = parse_grammar(body)
    if tools is not None and tools.offered:
        if logprobs is not None:
            raise bad_request("'logprobs' is not supported together with 'tools'.", "logprobs")
        if (forced := tools.grammar()) is not None:
            if grammar is not None:
                raise bad_request(
                    f"'{grammar.param}' cannot be combined with a forced tool call.",
                    param=grammar.param,
                )
            grammar = forced
    return ChatRequest(
        model=_model(body),
        messages=_messages(body.get("messages")),
        max_tokens=max_tokens,
        sampling=replace(_sampling(body), logprobs=logprobs),
        stream=stream,
        include_usage=include_usage,
        min_tokens=_opt_int(body, "min_tokens", lo=0) or 0,
        grammar=grammar,
        tools=tools,
        priority=_priority(body),
    )


# --- fields -------------------------------------------------------------------------------------


def _priority(body: dict[str, Any]) -> int | None:
    """vLLM's `priority`: lower is served first; the Batch API's lines run below every range."""
    return _opt_int(body, "priority", PRIORITIES[0], PRIORITIES[-1] - 1)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(
    body: dict[str, Any], name: str, lo: int = -_INT64, hi: int = _INT64 - 1
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer.", param=name)
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}.", param=name)
    return value


def _opt_number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number.", param=name)
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}.", param=name)
    return float(value)


def _opt_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", param=name)
    return value


def _model(body: dict[str, Any]) -> str | None:
    value = body.get("model")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request("'model' must be a non-empty string.", param="model")
    if len(value) > MAX_MODEL_NAME_CHARS:
        raise bad_request(
            f"'model' must be at most {MAX_MODEL_NAME_CHARS} characters.", param="model"
        )
    return _unicode(value, "model")


def _unicode(value: str, param: str) -> str:
    """JSON's \\uD800-style escapes can smuggle lone surrogates into a str; they cannot be
    encoded (tokenizer, Redis, JSON out), so refuse them here rather than fail later with 500."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                f"'{param}' contains an unpaired UTF-16 surrogate (invalid Unicode).", param=param
            ) from None
    return value


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    if not stream:
        raise bad_request(
            "'stream_options' is only allowed with 'stream': true.", param="stream_options"
        )
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request(
            "'stream_options.include_usage' must be a boolean.",
            param="stream_options.include_usage",
        )
    return stream, bool(include)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    """Every sampling field but max_tokens, whose name and default depend on the route."""
    top_k = _opt_int(body, "top_k", lo=-1)
    return SamplingParams(
        n=_opt_int(body, "n", 1, MAX_CHOICES) or 1,
        temperature=_opt_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        top_k=max(top_k or 0, 0),  # OpenAI-style clients send -1 for "off"; the wire uses 0
        seed=_opt_int(body, "seed"),
        stop=tuple(_stop(body.get("stop"))),
        stop_token_ids=tuple(
            _token_ids(body.get("stop_token_ids"), "stop_token_ids", True, MAX_STOP_TOKEN_IDS)
        ),
        ignore_eos=_opt_bool(body, "ignore_eos"),
        presence_penalty=_opt_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_opt_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_repetition_penalty(body),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat asks with `logprobs: true` and `top_logprobs: k` (alternatives per token)."""
    top = _opt_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _opt_bool(body, "logprobs"):
        if top:
            raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
        return None
    return top or 0


def _repetition_penalty(body: dict[str, Any]) -> float:
    value = _opt_number(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if value == 0:
        raise bad_request("'repetition_penalty' must be greater than 0.", "repetition_penalty")
    return value


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} (ids as strings, JSON keys); the ids are
    checked against the vocabulary in gateway.generate."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object of token ids to numbers.", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries.", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
            raise bad_request("'logit_bias' keys must be token ids (integers >= 0).", "logit_bias")
        ok = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not ok or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise bad_request("'logit_bias' values must be numbers in [-100, 100].", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _top_p(body: dict[str, Any]) -> float:
    top_p = _opt_number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:  # keeps no token at all
        raise bad_request("'top_p' must be greater than 0.", param="top_p")
    return top_p


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of them.", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings.", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(
            f"Each 'stop' string must be at most {MAX_STOP_CHARS} characters.", param="stop"
        )
    return [_unicode(s, "stop") for s in stops]


def _token_ids(
    value: Any, param: str, allow_empty: bool = False, max_len: int | None = None
) -> list[int]:
    if value is None and allow_empty:
        return []
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise bad_request(
            f"'{param}' must be a list of integers between 0 and {MAX_TOKEN_ID}.", param=param
        )
    if not value and not allow_empty:
        raise bad_request(f"'{param}' must not be empty.", param=param)
    if max_len is not None and len(value) > max_len:
        raise bad_request(f"'{param}' may hold at most {max_len} ids.", param=param)
    return value


def _prompt(value: Any) -> str | list[int]:
    if value is None:
        raise bad_request("'prompt' is required.", param="prompt")
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) > 1:
            raise bad_request(
                "Several prompts in one request are not supported; send one per request.",
                param="prompt",
            )
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad_request("'prompt' must not be empty.", param="prompt")
        return _unicode(value, "prompt")
    if isinstance(value, list):
        return _token_ids(value, "prompt")
    raise bad_request("'prompt' must be a string or a list of token ids.", param="prompt")


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad_request("'messages' is required.", param="messages")
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list.", param="messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object.", param=param)
    role = value.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(
            f"'{param}.role' must be one of {', '.join(sorted(ROLES))}.", param=f"{param}.role"
        )
    content = value.get("content")
    calls = value.get("tool_calls") if role == "assistant" else None
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(p, f"{param}.content[{j}]") for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise bad_request(
            f"'{param}.content' must be a string or a list of text parts.",
            param=f"{param}.content",
        )
    message: dict[str, Any] = {"role": role, "content": _unicode(content, f"{param}.content")}
    for key in ("name", "tool_call_id") if role == "tool" else ("name",):
        if (text := value.get(key)) is not None:
            if not isinstance(text, str):
                raise bad_request(f"'{param}.{key}' must be a string.", param=f"{param}.{key}")
            message[key] = _unicode(text, f"{param}.{key}")
    if calls is not None:
        message["tool_calls"] = _tool_calls(calls, f"{param}.tool_calls")
    return message


def _tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, in OpenAI's shape (arguments: a JSON string)."""
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be a list of tool calls.", param=param)
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        ok = isinstance(function, dict)
        fields = [function.get(k) for k in ("name", "arguments")] if ok else [None]
        call_id = call.get("id", "") if isinstance(call, dict) else None
        if not isinstance(call_id, str) or not all(isinstance(f, str) for f in fields):
            raise bad_request(
                f"'{param}[{i}]' must be {{id, type: function, function: {{name, arguments}}}}"
                " with string values.",
                param=f"{param}[{i}]",
            )
        name, arguments = (_unicode(f, f"{param}[{i}].function") for f in fields)
        function = {"name": name, "arguments": arguments}
        calls.append(
            {"id": _unicode(call_id, f"{param}[{i}].id"), "type": "function", "function": function}
        )
    return calls


def _text_part(part: Any, param: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise bad_request(f"'{param}' must be a text part; only text is supported.", param=param)
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"'{param}.text' must be a string.", param=f"{param}.text")
    return text


# --- known OpenAI fields we cannot honour: allowed only with their "off" value ------------------

Check = Callable[[Any], bool]


def _off(*values: Any) -> Check:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


def _refuse_unsupported(body: dict[str, Any], table: dict[str, Check]) -> None:
    for name, is_off in table.items():
        if name in body and not is_off(body[name]):
            raise bad_request(f"'{name}' is not supported by this server.", param=name)


_COMPLETION_UNSUPPORTED: dict[str, Check] = {
    "suffix": _off(""),
}
_CHAT_UNSUPPORTED: dict[str, Check] = {
    "best_of": _off(1),  # not an OpenAI chat field; vLLM's, for beam search
}
