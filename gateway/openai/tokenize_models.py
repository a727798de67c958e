"""The bodies of POST /tokenize and /detokenize in vLLM's shapes, as pydantic models (a 400
naming the field, gateway.openai.validation).

/tokenize takes a prompt (`TokenizePrompt`) or a chat (`TokenizeChat`, with tools as on
/v1/chat/completions); a body with `messages` is a chat. Token ids are checked against the
vocabulary in the route, which has the model.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, model_validator

from gateway.openai.chat_messages import Messages, TemplateKwargs
from gateway.openai.errors import bad_request
from gateway.openai.field_types import (
    REQUIRED,
    Boolean,
    Flag,
    Text,
    TokenIds,
    absent_is_null,
    none_is,
)
from gateway.openai.generation_fields import ModelName
from gateway.openai.tools import ToolFields
from gateway.openai.validation import Invalid, validate

FlagTrue = Annotated[Boolean, none_is(True)]  # null or absent: true


class TokenizeBody(BaseModel):
    model: ModelName | None = None  # None: the only model served (lm-eval sends none)
    return_token_strs: Flag = False


class TokenizePrompt(TokenizeBody):
    prompt: Annotated[Text, REQUIRED] = absent_is_null()
    # True is what /v1/completions does with a text prompt (the tokenizer's own specials).
    add_special_tokens: FlagTrue = True


class TokenizeChat(TokenizeBody, ToolFields):
    messages: Annotated[Messages, REQUIRED] = absent_is_null()
    add_generation_prompt: FlagTrue = True
    continue_final_message: Flag = False
    # False: the template writes the special tokens itself (as /v1/chat/completions renders).
    add_special_tokens: Flag = False
    chat_template_kwargs: TemplateKwargs = {}

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChat:
        if self.continue_final_message and self.add_generation_prompt:
            raise Invalid(
                "cannot be true together with 'add_generation_prompt'",
                field="continue_final_message",
            )
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


class DetokenizeBody(BaseModel):
    model: ModelName | None = None
    tokens: Annotated[TokenIds, REQUIRED] = absent_is_null()


def parse_tokenize(body: dict[str, Any]) -> TokenizePrompt | TokenizeChat:
    if "messages" in body:
        return validate(TokenizeChat, body)
    if "prompt" not in body:
        raise bad_request("Send 'prompt' (a text) or 'messages' (a chat).", param="prompt")
    return validate(TokenizePrompt, body)


def parse_detokenize(body: dict[str, Any]) -> DetokenizeBody:
    return validate(DetokenizeBody, body)
