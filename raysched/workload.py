"""Workloads: the requests a run submits, from a seeded generator or a JSONL trace.

A workload YAML is either *synthetic*::

    requests: 24              # how many
    seed: 7                   # everything below is a pure function of this seed
    prompt_len: [8, 48]       # inclusive range, uniform
    max_new_tokens: [16, 48]  # inclusive range, uniform
    arrival_rate: inf         # requests/s of a Poisson process, or inf: all at t=0
    sampling:                 # optional; without it every request is greedy
      sampled_fraction: 0.5   # this share of requests samples (each with its own seed)
      temperature: 0.8
      top_p: 0.9

or a *trace*: ``trace: requests.jsonl`` (relative to the YAML file's folder), one JSON object per
line with ``prompt_ids`` (or ``prompt``: text, encoded with the model's tokenizer; a text prompt
also stops at the tokenizer's eos token unless ``ignore_eos``) and ``max_new_tokens``, and
optionally ``arrival_s``, ``priority`` (int, lower is more urgent), ``request_id`` and any other
sampling key (`raysched.sampling.SAMPLING_KEYS`: ``temperature``, ``top_p``, ``top_k``, ``seed``,
``min_tokens``, ``stop_token_ids``, ``stop``, ``ignore_eos``); blank lines are skipped.
`RequestSpec.to_dict` writes exactly such a line.

Problems raise `ConfigError` naming the key path, or the trace file and line. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from raysched.config import (
    Check,
    ConfigError,
    KeyPath,
    PathOrDict,
    check_finite_number,
    check_fields,
    check_mapping,
    check_nonempty_str,
    check_optional,
    check_positive_int,
    check_seed,
    parse_fields,
    read_config_source,
)
from raysched.sampling import SAMPLING_KEYS, RequestError, SamplingParams, check_priority, validate_prompt
from raysched.tokenizer import TextTokenizer, with_eos_stop

_ROOT = KeyPath("workload")
_SEED_BITS = 63  # per-request seeds fit a signed 64-bit integer too


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: what to submit, and when (seconds after the run starts)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_s: float = 0.0
    priority: int = 0  # lower is more urgent (as in vLLM)
    prompt: str | None = None  # the text `prompt_ids` were encoded from, if any

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.prompt_ids, tuple) or not self.prompt_ids:
            raise RequestError(f"prompt: must be a non-empty tuple of token ids, got {self.prompt_ids!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise RequestError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if not _is_number(self.arrival_s) or not 0 <= self.arrival_s < math.inf:
            raise RequestError(f"arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        check_priority(self.priority)

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError if a prompt id or stop id lies outside the vocabulary."""
        validate_prompt(self.prompt_ids, vocab_size)
        self.sampling.validate(vocab_size)

    def to_dict(self) -> dict[str, Any]:
        """One trace line's worth of plain data (see the module docstring)."""
        prompt = {"prompt_ids": list(self.prompt_ids)} if self.prompt is None else {"prompt": self.prompt}
        return {"request_id": self.request_id, **prompt, "arrival_s": self.arrival_s,
                "priority": self.priority, **self.sampling.to_dict()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------- config


def _check_fraction(value: Any, key: KeyPath) -> float:
    number = check_finite_number(value, key)
    if not 0 <= number <= 1:
        raise key.error(f"must be in [0, 1], got {value!r}")
    return number


def _check_temperature(value: Any, key: KeyPath) -> float:
    number = check_finite_number(value, key)
    if number <= 0:
        raise key.error(f"must be > 0 for sampled requests, got {value!r}")
    return number


def _check_top_p(value: Any, key: KeyPath) -> float:
    number = check_finite_number(value, key)
    if not 0 < number <= 1:
        raise key.error(f"must be in (0, 1], got {value!r}")
    return number


@dataclass(frozen=True)
class SyntheticSampling:
    """How the sampled share of a synthetic workload samples; the rest is greedy."""

    sampled_fraction: float = 1.0  # share of requests that sample (rounded to whole requests)
    temperature: float = 1.0
    top_p: float = 1.0

    CHECKS: ClassVar[dict[str, Check]] = {
        "sampled_fraction": _check_fraction,
        "temperature": _check_temperature,
        "top_p": _check_top_p,
    }

    def __post_init__(self) -> None:
        check_fields(self, _ROOT.child("sampling"))

    @classmethod
    def from_dict(cls, raw: Any, key: KeyPath = _ROOT.child("sampling")) -> SyntheticSampling:
        return cls(**parse_fields(cls, raw, key))


def _check_range(value: Any, key: KeyPath) -> tuple[int, int]:
    ok = (isinstance(value, tuple) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
          and 1 <= value[0] <= value[1])
    if not ok:
        shown = list(value) if isinstance(value, tuple) else value
        raise key.error(f"must be [min, max] with 1 <= min <= max, got {shown!r}")
    return value


def _parse_range(value: Any, key: KeyPath) -> tuple[int, int]:
    return _check_range(tuple(value) if isinstance(value, list) else value, key)


def _check_rate(value: Any, key: KeyPath) -> float:
    if not _is_number(value) or math.isnan(value) or value <= 0:
        raise key.error(f"must be a positive number of requests/s or 'inf', got {value!r}")
    return float(value)


def _parse_rate(value: Any, key: KeyPath) -> float:
    return _check_rate(math.inf if value == "inf" else value, key)


def _check_sampling(value: Any, key: KeyPath) -> SyntheticSampling | None:
    if value is not None and not isinstance(value, SyntheticSampling):
        raise key.error(f"must be a SyntheticSampling or None, got {type(value).__name__}")
    return value


def _check_trace(value: Any, key: KeyPath) -> Path | None:
    if value is not None and not isinstance(value, Path):
        raise key.error(f"must be a Path or None, got {type(value).__name__}")
    return value


def _parse_trace(value: Any, key: KeyPath) -> Path:
    return Path(check_nonempty_str(value, key))


@dataclass(frozen=True)
class WorkloadConfig:
    """A parsed workload file: synthetic (`requests` set) or a trace (`trace` set), never both."""

    requests: int | None = None  # synthetic: number of requests
    seed: int = 0
    prompt_len: tuple[int, int] = (8, 32)  # inclusive [min, max]
    max_new_tokens: tuple[int, int] = (16, 32)  # inclusive [min, max]
    arrival_rate: float = math.inf  # requests/s (Poisson); inf = all arrive at t=0
    sampling: SyntheticSampling | None = None  # None = all greedy
    trace: Path | None = None  # JSONL trace, resolved against the workload file's folder

    CHECKS: ClassVar[dict[str, Check]] = {
        "requests": check_optional(check_positive_int),
        "seed": check_seed,
        "prompt_len": _check_range,
        "max_new_tokens": _check_range,
        "arrival_rate": _check_rate,
        "sampling": _check_sampling,
        "trace": _check_trace,
    }
    PARSERS: ClassVar[dict[str, Check]] = {
        "prompt_len": _parse_range,
        "max_new_tokens": _parse_range,
        "arrival_rate": _parse_rate,
        "sampling": check_optional(SyntheticSampling.from_dict),
        "trace": _parse_trace,
    }

    def __post_init__(self) -> None:
        check_fields(self, _ROOT)
        if (self.requests is None) == (self.trace is None):
            raise _ROOT.error("needs exactly one of 'requests' (synthetic) or 'trace'")

    @classmethod
    def from_dict(cls, raw: Any) -> WorkloadConfig:
        mapping = check_mapping(raw, _ROOT, cls.CHECKS)
        if "trace" in mapping:
            extra = sorted(set(mapping) - {"trace"})
            if extra:
                raise _ROOT.error(f"{extra[0]!r} cannot be combined with 'trace' "
                                  "(a trace lists its own requests)")
        values = {name: cls.PARSERS.get(name, cls.CHECKS[name])(value, _ROOT.child(name))
                  for name, value in mapping.items()}
        return cls(**values)


def load_workload_config(path_or_dict: PathOrDict,
                         base_dir: str | os.PathLike[str] | None = None) -> WorkloadConfig:
    """Parse a workload YAML file (or dict) without generating requests.

    A relative `trace` is resolved against the YAML file's folder; for a dict, against
    `base_dir` (default: the current directory).

    >>> load_workload_config({"requests": 4, "arrival_rate": "inf"}).arrival_rate
    inf
    """
    config = WorkloadConfig.from_dict(read_config_source(path_or_dict, "workload"))
    if config.trace is None:
        return config
    if not isinstance(path_or_dict, Mapping):
        base_dir = Path(path_or_dict).parent
    return dataclasses.replace(config, trace=Path(base_dir or ".") / config.trace)


def load_workload(path_or_dict: PathOrDict, vocab_size: int,
                  base_dir: str | os.PathLike[str] | None = None) -> list[RequestSpec]:
    """Load a workload (YAML path or dict) and return its requests in order of arrival.

    The same file and `vocab_size` always give the same requests.

    >>> specs = load_workload({"requests": 3, "seed": 1, "prompt_len": [2, 4]}, vocab_size=100)
    >>> [s.request_id for s in specs], all(2 <= len(s.prompt_ids) <= 4 for s in specs)
    (['req-0000', 'req-0001', 'req-0002'], True)
    >>> specs == load_workload({"requests": 3, "seed": 1, "prompt_len": [2, 4]}, vocab_size=100)
    True
    """
    return build_requests(load_workload_config(path_or_dict, base_dir), vocab_size)


def build_requests(config: WorkloadConfig, vocab_size: int,
                   tokenizer: TextTokenizer | None = None) -> list[RequestSpec]:
    """The requests of a parsed workload, in order of arrival (ties keep file order).
    `tokenizer` encodes the text prompts of a trace (without one, they are an error)."""
    check_positive_int(vocab_size, KeyPath("workload", ("vocab_size",)))
    if config.trace is not None:
        return read_trace(config.trace, vocab_size, tokenizer)
    return synthesize(config, vocab_size)


# ---------------------------------------------------------------------------- synthetic


def synthesize(config: WorkloadConfig, vocab_size: int) -> list[RequestSpec]:
    """Seeded synthetic requests.

    Independent random streams, all derived from `config.seed`, draw the shapes (prompt lengths,
    prompt ids, max_new_tokens), the arrival times and the sampling choices, so changing, say,
    `arrival_rate` or `sampled_fraction` leaves the prompts as they were.
    """
    count = check_positive_int(config.requests, _ROOT.child("requests"))
    shapes = random.Random(f"{config.seed}/shapes")
    arrivals = _arrival_times(count, config.arrival_rate, random.Random(f"{config.seed}/arrivals"))
    params = _sampling_params(config, count, random.Random(f"{config.seed}/sampling"))
    specs = []
    for i in range(count):
        prompt = tuple(shapes.randrange(vocab_size) for _ in range(shapes.randint(*config.prompt_len)))
        sampling = dataclasses.replace(params[i], max_new_tokens=shapes.randint(*config.max_new_tokens))
        specs.append(RequestSpec(f"req-{i:04d}", prompt, sampling, arrivals[i]))
    return specs


def _arrival_times(count: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals (exponential gaps) at `rate` requests/s; all 0.0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def _sampling_params(config: WorkloadConfig, count: int, rng: random.Random) -> list[SamplingParams]:
    """Greedy or sampled params per request; every request gets its own seed."""
    seeds = [rng.getrandbits(_SEED_BITS) for _ in range(count)]
    mode = config.sampling
    if mode is None:
        return [SamplingParams(seed=seed) for seed in seeds]
    sampled = set(rng.sample(range(count), round(mode.sampled_fraction * count)))
    return [SamplingParams(temperature=mode.temperature, top_p=mode.top_p, seed=seed)
            if i in sampled else SamplingParams(seed=seed)
            for i, seed in enumerate(seeds)]


# ---------------------------------------------------------------------------- trace

_TRACE_KEYS = ("request_id", "prompt_ids", "prompt", "arrival_s", "priority", *SAMPLING_KEYS)


def read_trace(path: str | os.PathLike[str], vocab_size: int,
               tokenizer: TextTokenizer | None = None) -> list[RequestSpec]:
    """Requests from a JSONL trace, in order of arrival; a bad line raises ConfigError."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"workload: cannot read trace {os.fspath(path)}: {e}") from None
    specs: list[RequestSpec] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        key = KeyPath(f"workload: {os.fspath(path)}:{number}")
        spec = _parse_trace_line(line, key, vocab_size, f"req-{len(specs):04d}", tokenizer)
        if spec.request_id in seen:
            raise key.error(f"duplicate request_id {spec.request_id!r} (first on line {seen[spec.request_id]})")
        seen[spec.request_id] = number
        specs.append(spec)
    if not specs:
        raise ConfigError(f"workload: trace {os.fspath(path)} has no requests")
    return sorted(specs, key=lambda spec: spec.arrival_s)


def _parse_trace_line(line: str, key: KeyPath, vocab_size: int, default_id: str,
                      tokenizer: TextTokenizer | None) -> RequestSpec:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise key.error(f"malformed JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(raw, dict):
        raise key.error(f"expected a JSON object, got {type(raw).__name__}")
    check_mapping(raw, key, _TRACE_KEYS)
    if "max_new_tokens" not in raw:
        raise key.error("missing required key 'max_new_tokens'")
    if ("prompt_ids" in raw) == ("prompt" in raw):
        raise key.error("needs exactly one of 'prompt_ids' (token ids) and 'prompt' (text)")
    request_id = check_nonempty_str(raw.get("request_id", default_id), key.child("request_id"))
    arrival_s = check_finite_number(raw.get("arrival_s", 0.0), key.child("arrival_s"))
    if arrival_s < 0:
        raise key.child("arrival_s").error(f"must be >= 0, got {raw['arrival_s']!r}")
    try:
        sampling = {k: raw[k] for k in SAMPLING_KEYS if k in raw}
        text = raw.get("prompt")
        if text is not None:
            prompt = validate_prompt(_encode(text, tokenizer), vocab_size)
            sampling = with_eos_stop(sampling, tokenizer)
        else:
            prompt = validate_prompt(raw["prompt_ids"], vocab_size)
        params = SamplingParams.from_dict(sampling)
        params.validate(vocab_size)
        priority = check_priority(raw.get("priority", 0))
    except RequestError as e:
        raise ConfigError(f"{key.source}: {e}") from None
    return RequestSpec(request_id, prompt, params, arrival_s, priority, text)


def _encode(text: Any, tokenizer: TextTokenizer | None) -> list[int]:
    if not isinstance(text, str) or not text:
        raise RequestError(f"prompt: must be a non-empty string, got {text!r}")
    if tokenizer is None:
        raise RequestError("prompt: a text prompt needs the model's tokenizer, and none was given")
    return tokenizer.encode(text)
