"""OpenAI-compatible request parsing and response shapes (pure functions; no Ray, no HTTP).

`parse_completion` / `parse_chat` turn a request body into a `ParsedRequest` (prompt ids, sampling
params for the scheduler, response options) or raise `APIError` with the HTTP status and a message
naming the bad field. The ``*_response`` / ``*_chunk`` functions build the JSON bodies the
`openai` client expects, including vLLM's `return_token_ids` extension (`prompt_token_ids` and
per-choice `token_ids`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raysched.sampling import SAMPLING_KEYS, RequestError, SamplingParams
from raysched.tokenizer import TextTokenizer, with_eos_stop

DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 128}  # OpenAI's completions default; chat: ours
# HTTP names of the sampling keys (raysched.sampling.SAMPLING_KEYS): OpenAI's, where it has one
HTTP_NAMES = {"max_new_tokens": "max_tokens"}
_SAMPLING_HTTP = tuple(HTTP_NAMES.get(key, key) for key in SAMPLING_KEYS)
# accepted only at a neutral value (raysched does not implement them): key -> neutral values
_NEUTRAL: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
    "logit_bias": ({},), "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none", "auto")}
# informational: accepted and ignored (chat_template_kwargs go to the chat template)
_INFORMATIONAL = {"user": str, "metadata": dict, "store": bool, "service_tier": str, "chat_template_kwargs": dict}
_COMMON_KEYS = ("model", *_SAMPLING_HTTP, "stream", "stream_options", "return_token_ids", *_INFORMATIONAL,
                "n", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                "logit_bias", "response_format")
COMPLETION_KEYS = (*_COMMON_KEYS, "prompt", "echo", "best_of")
CHAT_KEYS = (*_COMMON_KEYS, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice")
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


class APIError(Exception):
    """An error answered as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


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
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far on every chunk
    max_tokens_field: str = "max_tokens"  # the HTTP field that set max_new_tokens (in error messages)
    shared_prefix: int = 0  # chat: the system message's tokens (`Client.submit`'s shared_prefix)


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
    """POST /v1/chat/completions: `messages` rendered through the tokenizer's chat template
    (with `chat_template_kwargs`, if any); `max_completion_tokens` wins over `max_tokens`."""
    body = _check_body(body, CHAT_KEYS, model_name)
    if tok is None:
        raise APIError(400, f"messages: model {model_name!r} has no tokenizer, so no chat template", "messages")
    max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_field in body:
        body["max_tokens"] = body.pop(max_field)
    extra = body.get("chat_template_kwargs") or {}
    try:
        text = tok.chat_prompt(body.get("messages"), extra=extra)
    except RequestError as err:
        raise APIError(400, str(err), "messages") from None
    prompt_ids = tok.encode(text)
    parsed = _parsed("chat", body, prompt_ids, tok, max_field)
    return dataclasses.replace(parsed, shared_prefix=_system_tokens(tok, body["messages"], extra, text, prompt_ids))


def _system_tokens(tok: TextTokenizer, messages: list, extra: dict, text: str, prompt_ids: list[int]) -> int:
    """The tokens of a leading system message that other messages follow, as the whole prompt
    starts with them (0: none, or the template renders it otherwise alone): the part of a chat
    prompt that other chats share, `ParsedRequest.shared_prefix`."""
    if len(messages) < 2 or messages[0].get("role") != "system":
        return 0
    try:
        alone = tok.chat_prompt(messages[:1], add_generation_prompt=False, extra=extra)
    except RequestError:
        return 0
    ids = tok.encode(alone) if alone and text.startswith(alone) else []
    return len(ids) if prompt_ids[:len(ids)] == ids else 0


def _check_body(body: Any, known: tuple[str, ...], model_name: str) -> dict:
    """The body without its nulls (an explicit null means absent), its keys checked."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise APIError(400, f"unsupported parameter {unknown[0]!r} (supported: {', '.join(known)})", unknown[0])
    body = {k: v for k, v in body.items() if v is not None}
    for key, neutral in _NEUTRAL.items():
        if key in body and not any(_same(body[key], value) for value in neutral):
            shown = " or ".join(json.dumps(v) for v in neutral)
            raise APIError(400, f"{key}: only {shown} is supported, got {json.dumps(body[key])}", key)
    for key, kind in _INFORMATIONAL.items():
        if key in body and not isinstance(body[key], kind):
            raise APIError(400, f"{key}: must be {_KIND_NAMES[kind]}, got {json.dumps(body[key])}", key)
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {model_name!r}", "model")
    for key in ("stream", "return_token_ids", "ignore_eos"):
        if key in body and not isinstance(body[key], bool):
            raise APIError(400, f"{key}: must be true or false, got {body[key]!r}", key)
    return body


_KIND_NAMES = {str: "a string", dict: "an object", bool: "true or false"}


def _same(value: Any, neutral: Any) -> bool:
    """`value` is `neutral`: equal, and a bool only where a bool is meant (true is not 1)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _parsed(kind: str, body: dict, prompt_ids: list[int], tok: TextTokenizer | None,
            max_field: str = "max_tokens") -> ParsedRequest:
    sampling = {key: body[name] for key, name in zip(SAMPLING_KEYS, _SAMPLING_HTTP) if name in body}
    sampling.setdefault("max_new_tokens", DEFAULT_MAX_TOKENS[kind])
    sampling.setdefault("temperature", 1.0)  # OpenAI's default, where raysched's own is greedy
    sampling.setdefault("seed", secrets.randbits(63))
    sampling = with_eos_stop(sampling, tok)
    try:
        params = SamplingParams.from_dict(sampling)
    except RequestError as err:
        raise request_error(err, max_field) from None
    if params.stop and tok is None:
        raise APIError(400, "stop: stop strings need the model's tokenizer", "stop")
    options = body.get("stream_options", {})
    if (not isinstance(options, Mapping) or set(options) - set(_STREAM_OPTIONS)
            or not all(isinstance(v, bool) or v is None for v in options.values())):
        raise APIError(400, f"stream_options: only {' and '.join(_STREAM_OPTIONS)} (true or false) are "
                            f"supported, got {json.dumps(options)}", "stream_options")
    return ParsedRequest(kind, prompt_ids, params.to_dict(), body.get("stream", False),
                         bool(options.get("include_usage")), body.get("return_token_ids", False),
                         bool(options.get("continuous_usage_stats")), max_field)


def request_error(err: RequestError, max_field: str = "max_tokens") -> APIError:
    """A 400 for a request the sampling checks or the scheduler refused, in HTTP's names
    (`max_tokens`, or `max_completion_tokens` when that was sent, for `max_new_tokens`); a
    message about the prompt alone ("prompt: ...") names `prompt`."""
    names = {**{key: HTTP_NAMES.get(key, key) for key in SAMPLING_KEYS}, "max_new_tokens": max_field}
    message = re.sub(r"\bmax_new_tokens\b", max_field, str(err)).removeprefix("sampling: ")
    if message.startswith("prompt: "):
        return APIError(400, message, "prompt")
    found = [(m.start(), key) for key in SAMPLING_KEYS if (m := re.search(rf"\b{key}\b", str(err)))]
    return APIError(400, message, names[min(found)[1]] if found else None)


# ---------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0) -> dict:
    """OpenAI's usage object; `cached_tokens=None` leaves out the details (a stream's usage so far)."""
    use = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        use["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return use


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
          finish_reason: str | None, first: bool = False, use: dict | None = None) -> dict:
    """One streamed chunk; a chat stream's first delta carries the role. `use`: usage so far
    (`stream_options.continuous_usage_stats`, as vLLM sends it)."""
    if req.kind == "chat":
        delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    _add_ids(choice, req, token_ids, with_prompt=first)
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        out["usage"] = use
    return out


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
