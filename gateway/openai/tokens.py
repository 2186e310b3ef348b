"""POST /tokenize and POST /detokenize, in vLLM's shapes, with the gateway's tokenizer.

- `/tokenize` takes `{model?, prompt, add_special_tokens?, return_token_strs?}` or `{model?, messages,
  add_generation_prompt?, return_token_strs?}` and answers `{count, max_model_len, tokens, token_strs}`. The
  ids are the ones the generation routes would feed the model: a prompt is tokenized as /v1/completions
  does (without special tokens unless asked, where vLLM adds them by default: its completions add them too),
  messages go through the chat template as /v1/chat/completions does, so `count` is the `prompt_tokens`
  those routes would report.
- `/detokenize` takes `{model?, tokens}` and answers `{prompt}` (special tokens kept, as vLLM does, so a
  round trip gives the templated text back).

`model` is optional, and when sent must be the served name (else 404, as on the generation routes). Bad
input is a 400 naming the field: a token id that is not an integer, negative, or outside the tokenizer's
vocabulary; more ids than one generation can span; a text longer than the longest prompt could be (the
gateway's own check, before tokenizing). The tokenizer runs on the gateway's tokenizer threads, so a long
text never stalls the event loop that streams every generation.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from gateway.core import Gateway, shown
from gateway.openai.models import model_limits
from gateway.openai.protocol import APIError, ChatInput, OpenAIRequestModel, Unsupported, must_be, parse_request
from gateway.openai.serving import Front


class _TokenizeBase(OpenAIRequestModel):
    model: str | None = Field(None, description="a string")
    return_token_strs: bool = Field(False, description="a boolean")


class TokenizeCompletionRequest(_TokenizeBase):
    prompt: str = Field(None, validate_default=True, description="a string")
    add_special_tokens: bool = Field(False, description="a boolean")

    _text = must_be("prompt", str, "must be a string")


# The chat input listed first: pydantic orders fields base by base from the last, so `model` is checked first.
class TokenizeChatRequest(ChatInput, _TokenizeBase):
    add_generation_prompt: bool = Field(True, description="a boolean")
    # vLLM's other chat fields; the chat route takes none of them, so neither does its token count
    continue_final_message: Unsupported = None
    add_special_tokens: Unsupported = None
    chat_template: Unsupported = None
    chat_template_kwargs: Unsupported = None
    tools: Unsupported = None
    mm_processor_kwargs: Unsupported = None


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = Field(None, description="a string")
    tokens: list[Any]

    _list = must_be("tokens", list, "must be a list of token ids")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenizer(front: Front):
    tok = front.gateway.tokenizer
    if tok is None:
        raise APIError(400, "this gateway has no tokenizer (it takes and returns token ids only)", None, "unsupported")
    return tok


async def _read_body(front: Front, request: Request) -> dict:
    """The JSON object (key, size and JSON checked by the front); `model` is optional here, and checked
    as on the generation routes when sent."""
    body = await front.read_json(request)
    if body.get("model") is not None:
        front._check_model(body["model"])
    return body


def _chat_ids(gateway: Gateway, messages: list[dict]) -> list[int]:
    """The chat prompt without the generation prompt: the turn Gateway.chat_prompt opens for the reply."""
    tok = gateway.tokenizer
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    # the gateway's plain template without its closing "assistant:"
    return gateway.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages))


def router(front: Front) -> APIRouter:
    api = APIRouter()

    @api.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _read_body(front, request)
        gateway, tok = front.gateway, _tokenizer(front)
        if "messages" in body and "prompt" in body:
            raise APIError(400, "send either 'prompt' or 'messages', not both", "messages", "invalid_value")
        ids: list[int]
        if "messages" in body:
            chat = parse_request(TokenizeChatRequest, body)
            messages = [m.to_prompt() for m in chat.messages]
            if chat.add_generation_prompt:  # exactly what the chat route feeds the model
                ids = await gateway.tokenize_chat(messages)
            else:
                gateway.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
                ids = await gateway.off_loop(_chat_ids, gateway, messages)
            want_strs = chat.return_token_strs
        else:
            req = parse_request(TokenizeCompletionRequest, body)
            if req.add_special_tokens:
                gateway.check_prompt_chars(len(req.prompt), "prompt")
                ids = (await gateway.off_loop(partial(tok, req.prompt, add_special_tokens=True)))["input_ids"]
            else:  # exactly what the completions route feeds the model
                ids = await gateway.tokenize(req.prompt)
            want_strs = req.return_token_strs
        strs = await gateway.off_loop(tok.convert_ids_to_tokens, ids) if want_strs else None
        limits = await model_limits(gateway)
        return TokenizeResponse(
            count=len(ids), max_model_len=limits.max_model_len, tokens=list(ids), token_strs=strs
        ).model_dump()

    @api.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = parse_request(DetokenizeRequest, await _read_body(front, request))
        gateway, tok = front.gateway, _tokenizer(front)
        cap = (await model_limits(gateway)).gateway_limit
        if len(req.tokens) > cap:
            raise APIError(
                400,
                f"'tokens' has {len(req.tokens)} ids: more than one generation spans here ({cap})",
                "tokens",
                "invalid_value",
            )
        vocab = len(tok)
        for i, t in enumerate(req.tokens):
            param = f"tokens[{i}]"
            if not isinstance(t, int) or isinstance(t, bool):
                raise APIError(400, f"'{param}' must be an integer token id, got {shown(t)}", param, "invalid_type")
            if not 0 <= t < vocab:
                raise APIError(
                    400, f"'{param}' must be a token id in [0, {vocab}), got {shown(t)}", param, "invalid_value"
                )
        return DetokenizeResponse(prompt=await gateway.off_loop(tok.decode, req.tokens)).model_dump()

    return api
