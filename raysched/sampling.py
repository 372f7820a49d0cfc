"""Per-request sampling parameters and request validation.

A `SamplingParams` is valid from the moment it exists (checked in ``__post_init__``); checks that
need the model's vocabulary run in `validate`. Bad user input raises `RequestError`, whose message
names the field and the value. This module never imports torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

MAX_SEED = 2**64  # seeds are unsigned 64-bit (the sampler mixes them with SplitMix64)


class RequestError(ValueError):
    """A request (prompt or sampling parameters) is invalid; the message names field and value."""


class UnknownRequestError(RequestError):
    """The scheduler does not know this request id (never did, forgot it, or restarted)."""


class RequestIdInUseError(RequestError):
    """The request id is taken (a resubmission to a scheduler that never lost the request)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: Any) -> bool:
    """An integer token id; numpy integers count, bools do not."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _field(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request: the one set of sampling keys that the driver
    (`client.submit`), trace files, `raysched generate` (one flag per field, from `help`) and HTTP
    (with OpenAI's `max_tokens` for `max_new_tokens`) all accept.

    temperature 0 is greedy; otherwise tokens are drawn from softmax(logits / temperature) over
    the top_k largest logits, cut to the top_p nucleus, with randomness that depends only on
    (seed, token index).

    >>> SamplingParams(max_new_tokens=8, temperature=0.7, seed=3).to_dict()["temperature"]
    0.7
    >>> SamplingParams(top_p=0)
    Traceback (most recent call last):
    ...
    raysched.sampling.RequestError: sampling: top_p must be in (0, 1], got 0
    """

    max_new_tokens: int = _field(16, "tokens to generate at most")
    temperature: float = _field(0.0, "0 is greedy")
    top_p: float = _field(1.0, "nucleus mass, in (0, 1]")
    top_k: int = _field(0, "sample among the k largest logits only (ties: lower id first); 0 or -1: all")
    seed: int = _field(0, "per-request randomness, in [0, 2**64)")
    min_tokens: int = _field(0, "stop tokens (eos included) and stop strings end nothing before this many tokens")
    stop_token_ids: tuple[int, ...] = _field((), "generation ends after emitting any of these")
    stop: tuple[str, ...] = _field((), "generation ends when the output text contains any of these")
    ignore_eos: bool = _field(False, "text prompts and HTTP: do not stop at the tokenizer's eos token")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise RequestError for a bad value; with `vocab_size`, stop ids must lie in the vocab."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise _error("max_new_tokens must be a positive integer", self.max_new_tokens)
        if not _is_finite_number(self.temperature) or self.temperature < 0:
            raise _error("temperature must be a finite number >= 0", self.temperature)
        if not _is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _error("top_p must be in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _error("top_k must be an integer >= -1 (0 or -1: all tokens)", self.top_k)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise _error(f"min_tokens must be an integer in [0, max_new_tokens ({self.max_new_tokens})]",
                         self.min_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise _error("ignore_eos must be true or false", self.ignore_eos)
        if not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED:
            raise _error("seed must be an integer in [0, 2**64)", self.seed)
        self._validate_stop_ids(vocab_size)
        self._validate_stop_strings()

    def _validate_stop_strings(self) -> None:
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise _error(f"stop must be a list of at most {MAX_STOP_STRINGS} strings", self.stop)
        for i, text in enumerate(self.stop):
            if not isinstance(text, str) or not 0 < len(text) <= MAX_STOP_CHARS:
                raise _error(f"stop[{i}] must be a non-empty string of at most {MAX_STOP_CHARS} characters", text)

    def _validate_stop_ids(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop_token_ids, tuple):
            raise _error("stop_token_ids must be a tuple of ints", self.stop_token_ids)
        upper = math.inf if vocab_size is None else vocab_size
        for i, token in enumerate(self.stop_token_ids):
            if not _is_int(token) or not 0 <= token < upper:
                bound = "a non-negative int" if vocab_size is None else f"an int in [0, {vocab_size})"
                raise _error(f"stop_token_ids[{i}] must be {bound}", token)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data; ``SamplingParams.from_dict(p.to_dict()) == p``."""
        return {name: list(v) if isinstance(v := getattr(self, name), tuple) else v for name in SAMPLING_KEYS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from plain data; absent keys take defaults, unknown keys raise RequestError.

        An explicit None (JSON null) means absent.

        >>> SamplingParams.from_dict({"max_new_tokens": 4, "stop_token_ids": [2], "seed": None}).to_dict()
        {'max_new_tokens': 4, 'temperature': 0.0, 'top_p': 1.0, 'top_k': 0, 'seed': 0, 'min_tokens': 0, \
'stop_token_ids': [2], 'stop': [], 'ignore_eos': False}
        """
        if not isinstance(data, Mapping):
            raise _error("sampling params must be a mapping", data)
        unknown = sorted(str(k) for k in data if k not in SAMPLING_KEYS)
        if unknown:
            raise RequestError(f"sampling: unknown key {unknown[0]!r} (known: {', '.join(SAMPLING_KEYS)})")
        values = {k: v for k, v in data.items() if v is not None}
        for name in ("stop_token_ids", "stop"):
            if name in values:
                values[name] = _as_tuple(values[name])
        if isinstance(values.get("stop"), str):  # OpenAI allows one string
            values["stop"] = (values["stop"],)
        for name in ("temperature", "top_p"):
            if name in values and _is_finite_number(values[name]):
                values[name] = float(values[name])
        return cls(**values)

    def finish_reason(self, token: int, num_generated: int) -> str | None:
        """Why a request ends with `token`, its `num_generated`-th token (the one just drawn):
        "stop" (a stop token, once more than `min_tokens` were drawn: the sampler keeps them out
        before), "length" (`max_new_tokens` reached), or None. One rule for every engine."""
        if token in self.stop_token_ids and num_generated > self.min_tokens:
            return "stop"
        if num_generated >= self.max_new_tokens:
            return "length"
        return None


SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def _error(what: str, value: Any) -> RequestError:
    return RequestError(f"sampling: {what}, got {value!r}")


def _as_tuple(value: Any) -> Any:
    """Lists become tuples; anything else is left for `validate` to reject."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """Check a prompt's token ids and return them as a tuple of ints.

    Raises RequestError for an empty prompt, a non-integer id, or an id outside [0, vocab_size),
    naming the first bad position and its value.

    >>> validate_prompt([1, 2, 3], vocab_size=10)
    (1, 2, 3)
    >>> validate_prompt([1, 12, 3], vocab_size=10)
    Traceback (most recent call last):
    ...
    raysched.sampling.RequestError: prompt: token id at position 1 is 12, outside [0, 10)
    """
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise RequestError(f"prompt: must be a sequence of token ids, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise RequestError("prompt: must not be empty")
    if all(type(t) is int for t in prompt_ids) and 0 <= min(prompt_ids) and max(prompt_ids) < vocab_size:
        return tuple(prompt_ids)  # the common case, in C loops; else find the first bad token
    for position, token in enumerate(prompt_ids):
        if not _is_token(token):
            raise RequestError(f"prompt: token id at position {position} must be an int, got {token!r}")
        if not 0 <= token < vocab_size:
            raise RequestError(
                f"prompt: token id at position {position} is {token}, outside [0, {vocab_size})")
    return tuple(int(token) for token in prompt_ids)


def check_priority(priority: object) -> int:
    """A request's priority: an int, lower is more urgent (vLLM's convention); default 0."""
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2**31:
        raise RequestError(f"priority must be an integer in (-2**31, 2**31), got {priority!r}")
    return priority
