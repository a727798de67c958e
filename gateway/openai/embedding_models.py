"""POST /v1/embeddings: the request body as a pydantic model (a 400 naming the field), and the
vectors as OpenAI's response gives them.

`input` is OpenAI's four shapes, each answered as a list of inputs: a string, a list of strings,
a list of token ids, or a list of lists of token ids (an error names the item, `input[2]`).
What needs the model (ids within the vocabulary, the context window, `dimensions` within the
vector) is checked in gateway.serving.embedding_path once the model is known.

The workers send each input's raw pooled vector; here it is truncated to `dimensions` (as a
Matryoshka model's vector is), L2-normalised (unless `normalize: false`, vLLM's field), rounded
to float32, and written as JSON numbers or as base64 of little-endian float32 (what OpenAI's
client decodes).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, PlainValidator

from gateway.openai.field_types import (
    MAX_TOKEN_ID,
    SURROGATE,
    Boolean,
    Integer,
    String,
    absent_is_null,
    between,
    check,
    encodable,
    none_is,
)
from gateway.openai.generation_fields import ModelName
from gateway.openai.validation import Invalid, validate
from protocol import PRIORITIES, pack_vector, unpack_vector

# Inputs in one request, as OpenAI bounds them (each is a queue entry of its own): langchain's
# OpenAIEmbeddings sends 1,000 a request by default.
MAX_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")
INPUT_SHAPE = (
    "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
)


def _token_ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise Invalid(message=f"'{where}' must not be empty.")
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise Invalid(message=f"'{where}' must be a list of integers between 0 and {MAX_TOKEN_ID}.")
    return value


def _text(value: str, where: str) -> str:
    if not value:
        raise Invalid(message=f"'{where}' must not be an empty string.")
    if not encodable(value):
        raise Invalid(message=f"'{where}' {SURROGATE}.")
    return value


def _inputs(value: Any) -> list[str] | list[list[int]]:
    """Every shape as a list of inputs (texts, or token id lists), each checked."""
    if value is None:
        raise Invalid("is required")
    if isinstance(value, str):
        return [_text(value, "input")]
    if not isinstance(value, list):
        raise Invalid(INPUT_SHAPE)
    if not value:
        raise Invalid("must not be empty")
    if len(value) > MAX_INPUTS:
        raise Invalid(
            f"holds {len(value)} inputs; at most {MAX_INPUTS} are accepted in one request"
        )
    if all(isinstance(v, str) for v in value):
        return [_text(v, f"input[{i}]") for i, v in enumerate(value)]
    if all(isinstance(v, list) for v in value):
        return [_token_ids(v, f"input[{i}]") for i, v in enumerate(value)]
    if not any(isinstance(v, str | list) for v in value):
        return [_token_ids(value, "input")]
    raise Invalid(INPUT_SHAPE)


Inputs = Annotated[list[str] | list[list[int]], PlainValidator(_inputs)]


class EmbeddingRequest(BaseModel):
    model: ModelName | None = None
    input: Inputs = absent_is_null()
    encoding_format: Annotated[
        String,
        check(lambda v: v in ENCODING_FORMATS, "must be 'float' or 'base64'"),
        none_is("float"),
    ] = "float"
    # Honoured: each vector truncated to its first `dimensions` values, then normalised.
    dimensions: Annotated[Integer, check(lambda v: v >= 1, "must be at least 1")] | None = None
    user: String | None = None  # accepted, as OpenAI's end-user id; not used
    # vLLM's fields: priority (lower is served first), normalize, add_special_tokens.
    priority: Annotated[Integer, between(PRIORITIES[0], PRIORITIES[-1] - 1)] | None = None
    normalize: Annotated[Boolean, none_is(True)] = True
    add_special_tokens: Annotated[Boolean, none_is(True)] = True


def parse_embedding(body: dict[str, Any]) -> EmbeddingRequest:
    return validate(EmbeddingRequest, body)


def finish_vector(raw: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """A worker's raw vector as the client gets it: truncated, normalised, float32."""
    values = raw[:dimensions] if dimensions is not None else raw
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in values))
        if norm > 0:
            values = [v / norm for v in values]
    return unpack_vector(pack_vector(values))  # rounded to float32, as a base64 body holds


def embedding_item(index: int, values: list[float], encoding_format: str) -> dict[str, Any]:
    embedding: list[float] | str = values
    if encoding_format == "base64":
        embedding = pack_vector(values)
    return {"object": "embedding", "index": index, "embedding": embedding}


def embedding_body(model: str, items: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
