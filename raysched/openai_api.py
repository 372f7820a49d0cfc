"""OpenAI-compatible request parsing and response shapes (pure functions; no Ray, no HTTP).

`parse_completion` / `parse_chat` turn a request body into a `ParsedRequest` (prompt ids, sampling
params for the scheduler, response options) or raise `APIError` with the HTTP status and a message
naming the bad field. The ``*_response`` / ``*_chunk`` functions build the JSON bodies the
`openai` client expects, including vLLM's `return_token_ids` extension (`prompt_token_ids` and
per-choice `token_ids`).
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raysched.sampling import RequestError, SamplingParams
from raysched.tokenizer import TextTokenizer, with_eos_stop

DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 128}
_COMMON_KEYS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                "return_token_ids", "ignore_eos", "stop_token_ids", "user", "n", "logprobs",
                "presence_penalty", "frequency_penalty")
COMPLETION_KEYS = (*_COMMON_KEYS, "prompt", "echo", "best_of")
CHAT_KEYS = (*_COMMON_KEYS, "messages", "max_completion_tokens", "top_logprobs")
# accepted only at their neutral value (raysched does not implement them)
_NEUTRAL = {"n": 1, "logprobs": (None, False, 0), "echo": False, "best_of": 1, "presence_penalty": 0,
            "frequency_penalty": 0, "top_logprobs": (None, 0)}


class APIError(Exception):
    """An error answered as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    sampling: dict  # SamplingParams.to_dict() shape, for the scheduler
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    return_token_ids: bool


def parse_completion(body: Any, tok: TextTokenizer | None, model_name: str) -> ParsedRequest:
    """POST /v1/completions: `prompt` is text or a list of token ids (or a list holding one)."""
    body = _check_body(body, COMPLETION_KEYS, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tok is None:
            raise APIError(400, f"prompt: model {model_name!r} has no tokenizer; send token ids", "prompt")
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        prompt_ids = tok.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = list(prompt)
    else:
        raise APIError(400, "prompt: must be a string or a list of token ids (one prompt per request)", "prompt")
    return _parsed("completion", body, prompt_ids, tok)


def parse_chat(body: Any, tok: TextTokenizer | None, model_name: str) -> ParsedRequest:
    """POST /v1/chat/completions: `messages` rendered through the tokenizer's chat template."""
    body = _check_body(body, CHAT_KEYS, model_name)
    if tok is None:
        raise APIError(400, f"messages: model {model_name!r} has no tokenizer, so no chat template", "messages")
    if "max_completion_tokens" in body:
        body = {**body, "max_tokens": body.pop("max_completion_tokens")}
    try:
        text = tok.chat_prompt(body.get("messages"))
    except RequestError as err:
        raise APIError(400, str(err), "messages") from None
    return _parsed("chat", body, tok.encode(text), tok)


def _check_body(body: Any, known: tuple[str, ...], model_name: str) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise APIError(400, f"unsupported parameter {unknown[0]!r} (supported: {', '.join(known)})", unknown[0])
    for key, neutral in _NEUTRAL.items():
        if key in body and body[key] not in (neutral if isinstance(neutral, tuple) else (neutral,)):
            raise APIError(400, f"{key}: only {neutral!r} is supported, got {body[key]!r}", key)
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {model_name!r}", "model")
    for key in ("stream", "return_token_ids", "ignore_eos"):
        if key in body and not isinstance(body[key], bool):
            raise APIError(400, f"{key}: must be true or false, got {body[key]!r}", key)
    return dict(body)


def _parsed(kind: str, body: dict, prompt_ids: list[int], tok: TextTokenizer | None) -> ParsedRequest:
    def value(key: str, default: Any) -> Any:  # absent and null both mean the default
        return default if body.get(key) is None else body[key]

    sampling = {"max_new_tokens": value("max_tokens", DEFAULT_MAX_TOKENS[kind]),
                "temperature": value("temperature", 1.0), "top_p": value("top_p", 1.0),
                "seed": value("seed", secrets.randbits(63)), "stop": value("stop", []),
                "stop_token_ids": value("stop_token_ids", [])}
    if not body.get("ignore_eos", False):
        sampling = with_eos_stop(sampling, tok)
    try:
        params = SamplingParams.from_dict(sampling)
    except RequestError as err:
        raise APIError(400, _openai_names(str(err)), _param_of(str(err))) from None
    if params.stop and tok is None:
        raise APIError(400, "stop: stop strings need the model's tokenizer", "stop")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise APIError(400, f"stream_options: only include_usage is supported, got {options!r}", "stream_options")
    return ParsedRequest(kind, prompt_ids, params.to_dict(), bool(body.get("stream", False)),
                         bool(options.get("include_usage", False)), bool(body.get("return_token_ids", False)))


def _openai_names(message: str) -> str:
    return message.replace("max_new_tokens", "max_tokens").replace("sampling: ", "")


def _param_of(message: str) -> str | None:
    for key in ("max_new_tokens", "temperature", "top_p", "seed", "stop_token_ids", "stop"):
        if key in message:
            return {"max_new_tokens": "max_tokens"}.get(key, key)
    return None


# ---------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response(req: ParsedRequest, rid: str, model: str, text: str, token_ids: list[int],
             finish_reason: str | None, use: dict) -> dict:
    """A whole (non-streamed) completion or chat completion."""
    if req.kind == "chat":
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": text},
                        "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    _add_ids(choice, req, token_ids)
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": use}


def chunk(req: ParsedRequest, rid: str, model: str, text: str, token_ids: list[int],
          finish_reason: str | None, first: bool = False) -> dict:
    """One streamed chunk; a chat stream's first delta carries the role."""
    if req.kind == "chat":
        delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    _add_ids(choice, req, token_ids, with_prompt=first)
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(req: ParsedRequest, rid: str, model: str, use: dict) -> dict:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}


def _add_ids(choice: dict, req: ParsedRequest, token_ids: list[int], with_prompt: bool = True) -> None:
    if req.return_token_ids:
        choice["prompt_token_ids"] = list(req.prompt_ids) if with_prompt else None
        choice["token_ids"] = list(token_ids)


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "raysched"}]}
