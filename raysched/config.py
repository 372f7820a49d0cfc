"""Serving configuration: frozen, validated dataclasses loaded from YAML.

`load_serve_config` turns a YAML file (or a dict) into a `ServeConfig`. Every key is checked:
an unknown key, a wrong type or a bad value raises `ConfigError`, whose message names the full
key path, e.g. ``serve config: pool.kv_tokens must be a positive integer, got -3``. Objects
built directly in code are validated the same way (in ``__post_init__``), so an invalid config
cannot exist. Configs are never mutated: derive a new one with `dataclasses.replace`.

The small helpers here (`KeyPath`, the ``check_*`` functions, `read_yaml`) are shared with
`raysched.workload`. This module never imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeAlias

import yaml

RETRACT_MODES = ("snapshot", "recompute", "auto")
ADMISSION_MODES = ("overcommit", "reserve")
VICTIM_ORDERS = ("fewest_generated", "most_generated", "newest", "oldest", "largest_memory")
DTYPES = ("float32", "bfloat16")
DATA_PLANES = ("torch", "sim")
DEVICES = ("auto", "cuda", "cpu")
FAULT_KINDS = ("kill_worker", "remove_node", "corrupt_snapshot", "kill_in_step", "kill_in_join",
               "kill_in_retract", "kill_in_restore", "kill_scheduler", "kill_migration_source",
               "kill_migration_dest", "refuse_migration")
MIGRATION_KILLS = ("kill_migration_source", "kill_migration_dest")
MAX_SEED = 2**64  # seeds are unsigned 64-bit (the sampler mixes them with SplitMix64)

PathOrDict: TypeAlias = str | os.PathLike[str] | Mapping[str, Any]


class ConfigError(ValueError):
    """A configuration is invalid; the message names the source and the full key path."""


# ---------------------------------------------------------------------------- key paths


@dataclass(frozen=True)
class KeyPath:
    """Where a value sits in a config, for error messages: ``serve config: pool.kv_tokens``.

    >>> KeyPath("serve config").child("faults").item(1).child("worker").error("is bad")
    ConfigError('serve config: faults[1].worker is bad')
    """

    source: str  # what is being read: "serve config", "workload", "workload: t.jsonl:3"
    parts: tuple[str, ...] = ()

    def child(self, name: str) -> KeyPath:
        return KeyPath(self.source, (*self.parts, name))

    def item(self, index: int) -> KeyPath:
        last = self.parts[-1] if self.parts else ""
        return KeyPath(self.source, (*self.parts[:-1], f"{last}[{index}]"))

    def error(self, message: str) -> ConfigError:
        where = f" {self}" if self.parts else ""
        return ConfigError(f"{self.source}:{where} {message}")

    def __str__(self) -> str:
        return ".".join(self.parts)


Check: TypeAlias = Callable[[Any, KeyPath], Any]  # returns the (normalised) value or raises


def suggestion(name: str, known: Collection[str]) -> str:
    """A hint for a misspelt name: `` (did you mean 'x'?)``, or the list of known names."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (known: {', '.join(sorted(known))})"


def unknown_key(key: KeyPath, name: Any, known: Collection[str]) -> ConfigError:
    full = str(key.child(str(name)))
    hint = suggestion(name, known) if isinstance(name, str) else ""
    return ConfigError(f"{key.source}: unknown key {full!r}{hint}")


def check_mapping(value: Any, key: KeyPath, known: Collection[str]) -> Mapping[str, Any]:
    """`value` as a mapping whose keys are all in `known`; None counts as empty."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise key.error(f"must be a mapping, got {_describe(value)}")
    for name in value:
        if name not in known:
            raise unknown_key(key, name, known)
    return value


# ---------------------------------------------------------------------------- value checks


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if isinstance(value, (list, dict)) else repr(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least(value: Any, key: KeyPath, minimum: int, what: str) -> int:
    if not _is_int(value) or value < minimum:
        raise key.error(f"must be {what}, got {_describe(value)}")
    return value


def check_positive_int(value: Any, key: KeyPath) -> int:
    return _int_at_least(value, key, 1, "a positive integer")


def check_non_negative_int(value: Any, key: KeyPath) -> int:
    return _int_at_least(value, key, 0, "a non-negative integer")


def check_fold_calls(value: Any, key: KeyPath) -> int:
    return _int_at_least(value, key, 2, "an integer >= 2 (2: a call folds one successor)")


def check_seed(value: Any, key: KeyPath) -> int:
    if not _is_int(value) or not 0 <= value < MAX_SEED:
        raise key.error(f"must be an integer in [0, 2**64), got {_describe(value)}")
    return value


def check_bool(value: Any, key: KeyPath) -> bool:
    if not isinstance(value, bool):
        raise key.error(f"must be true or false, got {_describe(value)}")
    return value


def check_nonempty_str(value: Any, key: KeyPath) -> str:
    if not isinstance(value, str) or not value.strip():
        raise key.error(f"must be a non-empty string, got {_describe(value)}")
    return value


def check_finite_number(value: Any, key: KeyPath) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise key.error(f"must be a finite number, got {_describe(value)}")
    return float(value)


def check_non_negative_number(value: Any, key: KeyPath) -> float:
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise key.error(f"must be a finite number >= 0, got {_describe(value)}")
    return float(value)


def check_fraction(value: Any, key: KeyPath) -> float:
    if not _is_number(value) or not 0 <= value <= 1:
        raise key.error(f"must be a number in [0, 1], got {_describe(value)}")
    return float(value)


def check_one_of(choices: tuple[str, ...]) -> Check:
    """A check accepting exactly one of `choices`."""

    def check(value: Any, key: KeyPath) -> str:
        if value not in choices or not isinstance(value, str):
            hint = suggestion(value, choices) if isinstance(value, str) else ""
            raise key.error(f"must be one of {' | '.join(choices)}, got {_describe(value)}{hint}")
        return value

    return check


def check_optional(check: Check) -> Check:
    """A check that also accepts None (YAML ``null`` or an absent key)."""

    def optional(value: Any, key: KeyPath) -> Any:
        return None if value is None else check(value, key)

    return optional


def check_fields(obj: Any, key: KeyPath) -> None:
    """Run the class's ``CHECKS`` on the attributes of a (frozen) dataclass instance."""
    for name, check in type(obj).CHECKS.items():
        check(getattr(obj, name), key.child(name))


def parse_fields(cls: type, raw: Any, key: KeyPath) -> dict[str, Any]:
    """Check a raw mapping against ``cls.CHECKS`` and return the checked values by field name."""
    mapping = check_mapping(raw, key, cls.CHECKS)
    return {name: cls.CHECKS[name](value, key.child(name)) for name, value in mapping.items()}


class Section:
    """A config section: a frozen dataclass whose fields `CHECKS` checks, found under `KEY`
    (checked again on construction, so one built in code is held to the same rules)."""

    KEY: ClassVar[KeyPath]
    CHECKS: ClassVar[dict[str, Check]]
    REQUIRED: ClassVar[tuple[str, ...]] = ()  # fields without a default
    OPTIONAL: ClassVar[bool] = False  # True: an absent (null) section is None, the feature off

    def __post_init__(self) -> None:
        check_fields(self, self.KEY)

    @classmethod
    def from_dict(cls, raw: Any, key: KeyPath | None = None) -> Any:
        if raw is None and cls.OPTIONAL:
            return None
        key = cls.KEY if key is None else key
        values = parse_fields(cls, raw, key)
        missing = [name for name in cls.REQUIRED if name not in values]
        if missing:
            raise key.error(f"is missing required key(s): {', '.join(missing)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.CHECKS}


# ---------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Hashable] = set()
    for key_node, _ in node.value:
        name = loader.construct_object(key_node, deep=True)
        if isinstance(name, Hashable) and name in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {name!r}", key_node.start_mark)
        if isinstance(name, Hashable):
            seen.add(name)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str | os.PathLike[str], source: str) -> Any:
    """Parse a YAML file; unreadable or malformed files raise ConfigError with file and line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot read {os.fspath(path)}: {e}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{os.fspath(path)}:{mark.line + 1}" if mark else os.fspath(path)
        raise ConfigError(f"{source}: {where}: malformed YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: {os.fspath(path)}: malformed YAML: {e}") from None


def read_config_source(path_or_dict: PathOrDict, source: str) -> Any:
    """A dict as is, or the parsed content of a YAML file."""
    if isinstance(path_or_dict, Mapping):
        return path_or_dict
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigError(f"{source}: expected a YAML path or a dict, got {type(path_or_dict).__name__}")
    return read_yaml(path_or_dict, source)


# ---------------------------------------------------------------------------- dataclasses

_SOURCE = "serve config"
_ROOT = KeyPath(_SOURCE)
_COUNT_FIELDS = frozenset({"kv_tokens", "state_slots"})
log = logging.getLogger("raysched.config")


def rename_deprecated(raw: Any, key: KeyPath, renamed: Mapping[str, str]) -> Any:
    """A mapping with old key names replaced by their new ones, each with a one-line notice; both
    names at once is an error. (Keys users already write keep working.)"""
    if not isinstance(raw, Mapping) or not any(old in raw for old in renamed):
        return raw
    out = dict(raw)
    for old, new in renamed.items():
        if old not in out:
            continue
        if new in out:
            raise key.child(old).error(f"is the old name of {key.child(new)}; give only one of them")
        log.warning("serve config: %s is deprecated; call it %s", key.child(old), key.child(new))
        out[new] = out.pop(old)
    return out


@dataclass(frozen=True)
class PoolConfig:
    """Per-worker capacity of the two state pools.

    Capacity is given either as counts (`kv_tokens`, `state_slots`) or as a byte budget
    (`memory_bytes`). With a budget, `resolve` turns bytes into counts once the model's sizes
    are known; a count the user gave explicitly (listed in `explicit`, filled by the loader)
    wins over the budget, and the budget fills in the other:

    - both counts given: the budget is not used;
    - only kv_tokens given: the state pool takes what the budget has left;
    - otherwise: state_slots (given, or its default 8) are reserved first and the KV pool
      takes the rest, rounded down to whole pages.
    """

    kv_tokens: int = 512  # attention KV capacity per worker, in tokens (a multiple of page_size)
    state_slots: int = 8  # recurrent-state slots per worker (Mamba, GDN) = most requests running at
    #   once; `mamba_slots` is its deprecated name
    page_size: int = 1  # tokens per KV page
    memory_bytes: int | None = None  # byte budget for both pools per worker, see `resolve`
    explicit: frozenset[str] = frozenset()  # with memory_bytes: counts the user set (they win)

    CHECKS: ClassVar[dict[str, Check]] = {
        "kv_tokens": check_positive_int,
        "state_slots": check_positive_int,
        "page_size": check_positive_int,
        "memory_bytes": check_optional(check_positive_int),
    }

    def __post_init__(self) -> None:
        key = _ROOT.child("pool")
        check_fields(self, key)
        if self.kv_tokens % self.page_size:
            raise key.child("kv_tokens").error(
                f"must be a multiple of pool.page_size ({self.page_size}), got {self.kv_tokens}")
        if not isinstance(self.explicit, frozenset) or not self.explicit <= _COUNT_FIELDS:
            raise key.child("explicit").error(
                f"must be a frozenset of {sorted(_COUNT_FIELDS)}, got {self.explicit!r}")

    RENAMED: ClassVar[dict[str, str]] = {"mamba_slots": "state_slots"}

    @classmethod
    def from_dict(cls, raw: Any, key: KeyPath = _ROOT.child("pool")) -> PoolConfig:
        values = parse_fields(cls, rename_deprecated(raw, key, cls.RENAMED), key)
        if values.get("memory_bytes") is not None:
            values["explicit"] = frozenset(values) & _COUNT_FIELDS
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The YAML form; with a budget, only the counts given explicitly are written."""
        out: dict[str, Any] = {"kv_tokens": self.kv_tokens, "state_slots": self.state_slots,
                               "page_size": self.page_size, "memory_bytes": self.memory_bytes}
        if self.memory_bytes is not None:
            for name in _COUNT_FIELDS - self.explicit:
                del out[name]
        return out

    def resolve(self, kv_bytes_per_token: int, state_bytes_per_slot: int) -> PoolConfig:
        """Counts for a byte budget; returns self when there is no budget or nothing to derive.

        >>> pool = PoolConfig.from_dict({"memory_bytes": 10_000})
        >>> sized = pool.resolve(kv_bytes_per_token=10, state_bytes_per_slot=360)
        >>> sized.kv_tokens, sized.state_slots  # 8 slots * 360 B + 712 tokens * 10 B <= 10_000 B
        (712, 8)
        """
        check_positive_int(kv_bytes_per_token, KeyPath("resolve", ("kv_bytes_per_token",)))
        check_positive_int(state_bytes_per_slot, KeyPath("resolve", ("state_bytes_per_slot",)))
        if self.memory_bytes is None or self.explicit == _COUNT_FIELDS:
            return self
        slots, tokens = self._fill_budget(self.memory_bytes, kv_bytes_per_token, state_bytes_per_slot)
        tokens -= tokens % self.page_size
        if slots < 1 or tokens < self.page_size:
            raise _ROOT.child("pool").child("memory_bytes").error(
                f"= {self.memory_bytes} B cannot hold {max(slots, 1)} state slot(s) of"
                f" {state_bytes_per_slot} B plus {max(tokens, self.page_size)} KV token(s) of"
                f" {kv_bytes_per_token} B")
        return dataclasses.replace(self, kv_tokens=tokens, state_slots=slots, explicit=_COUNT_FIELDS)

    def _fill_budget(self, budget: int, kv_bytes_per_token: int, state_bytes_per_slot: int) -> tuple[int, int]:
        """(state_slots, kv_tokens) filling `budget`; explicit counts are kept as they are."""
        if self.explicit == {"kv_tokens"}:
            return (budget - self.kv_tokens * kv_bytes_per_token) // state_bytes_per_slot, self.kv_tokens
        return self.state_slots, (budget - self.state_slots * state_bytes_per_slot) // kv_bytes_per_token


@dataclass(frozen=True)
class RebalanceConfig(Section):
    """Load balancing by live migration (`raysched.scheduler.rebalance`): every `interval_s`,
    when the virtual usage of the most and the least loaded worker differs by more than
    `threshold`, one running request moves from the first to the second."""

    enabled: bool = True  # off: requests move only when retracted, drained or migrated by hand
    threshold: float = 0.25  # virtual usage gap (a fraction of a pool) that starts a move
    interval_s: float = 0.25  # how often the loads are compared
    max_moves: int = 1  # migrations in flight at once

    KEY: ClassVar[KeyPath] = _ROOT.child("scheduler").child("rebalance")
    CHECKS: ClassVar[dict[str, Check]] = {
        "enabled": check_bool,
        "threshold": check_fraction,
        "interval_s": check_finite_number,
        "max_moves": check_positive_int,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.interval_s <= 0:
            raise self.KEY.child("interval_s").error(f"must be > 0, got {self.interval_s}")

    @classmethod
    def parse(cls, raw: Any, key: KeyPath) -> RebalanceConfig:
        return raw if isinstance(raw, cls) else cls.from_dict(raw, key)


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches, retracts and resumes requests."""

    retract: str = "snapshot"  # snapshot | recompute | auto: how a retracted request resumes
    admission: str = "overcommit"  # overcommit: admit while the next steps fit, retract on
    #   overflow | reserve: no-overcommit baseline, every request keeps room for its whole budget
    victim_order: str = "fewest_generated"  # which running request is retracted first
    decode_steps_per_call: int = 4  # decode steps a worker runs per scheduler decision (1 while
    #   prompts on it wait for their next chunk: `planner.prefill_backlog`)
    fold_successor: bool = True  # a call whose successor needs no decision runs the successor's
    #   steps too (one Ray call instead of two); False: the successor is a second, pipelined call
    fold_calls: int = 64  # with fold_successor: a call runs up to this many calls' decode steps
    #   while none of them needs a decision; one that runs more than 2 ends early when the
    #   scheduler interrupts it (a request waits for room, an abort, a drain, a migration).
    #   With finish notices a finish no longer ends it: this bounds how long its call runs
    #   (and how stale the scheduler's copy of unstreamed tokens gets); 16 before them
    interrupt_after_ms: float = 20.0  # a request that has waited this long for room interrupts
    #   long calls; sooner, a call that ends anyway starts it (with many workers, one soon does)
    join_long_calls: bool = True  # a request that has waited `join_after_ms` starts inside a long
    #   call with room (`Worker.join`: no interrupt, the worker decodes on), on workers that take
    #   joins (`WorkerInfo.joins`) and without prefix reuse
    join_after_ms: float = 2.0  # how long a request waits for a call that ends before it joins one
    finish_notices: bool = True  # a long call that takes joins (and replies once) goes on past a
    #   request's finish: its worker tells the scheduler at once, which ends the request there and
    #   gives its room to joins (False: the call ends after that step, and its next call waits for
    #   a round trip through the scheduler)
    stream_each_step: bool = True  # a request whose client streams it gets each decode step's
    #   tokens as that step completes (its worker's calls stream); False: once per call
    force_retract_every: int = 0  # testing: 0 = off; else retract one request per worker at the
    #   first decision at or after every k-th call (pipelining stays on)
    max_retractions: int = 8  # a request retracted this many times is never retracted again
    debug_drop_state: bool = False  # testing, deliberately broken: zero the recurrent state on
    #   resume (the negative control; `debug_drop_mamba_state` is its deprecated name)
    max_batch_size: int | None = None  # most requests per decode step; None = state_slots
    snapshot_budget_bytes: int | None = None  # bytes of waiting snapshots the scheduler keeps in
    #   the object store; past it, victims are retracted by recompute. None = half the store
    replace_failed_workers: bool = True  # start a new worker when one dies (if resources allow)
    max_worker_failures: int = 3  # a worker and its replacements failing this many times in a row
    #   (no successful call between) stop the scheduler: no more replacements, every request fails
    #   with the worker's error in one line
    preemption: bool = True  # a more urgent request that finds no room retracts less urgent ones
    prefill_chunk_tokens: int = 512  # most prompt tokens a request prefills per worker call, so
    #   a long prompt does not stall the decode steps of the others; 0 = whole prompts at once
    prefill_budget_tokens: int = 512  # most prompt tokens a worker call feeds in all: new prompts
    #   first, then those still prefilling, oldest first, each by a whole chunk (so a call stays
    #   short and an urgent prompt waits for one chunk, not for every long prompt's); 0 = no cap
    rebalance: RebalanceConfig = RebalanceConfig()  # load balancing by live migration

    CHECKS: ClassVar[dict[str, Check]] = {
        "retract": check_one_of(RETRACT_MODES),
        "admission": check_one_of(ADMISSION_MODES),
        "victim_order": check_one_of(VICTIM_ORDERS),
        "decode_steps_per_call": check_positive_int,
        "fold_successor": check_bool,
        "fold_calls": check_fold_calls,
        "interrupt_after_ms": check_non_negative_number,
        "join_long_calls": check_bool,
        "join_after_ms": check_non_negative_number,
        "finish_notices": check_bool,
        "stream_each_step": check_bool,
        "force_retract_every": check_non_negative_int,
        "max_retractions": check_non_negative_int,
        "debug_drop_state": check_bool,
        "max_batch_size": check_optional(check_positive_int),
        "snapshot_budget_bytes": check_optional(check_non_negative_int),
        "replace_failed_workers": check_bool,
        "max_worker_failures": check_positive_int,
        "preemption": check_bool,
        "prefill_chunk_tokens": check_non_negative_int,
        "prefill_budget_tokens": check_non_negative_int,
        "rebalance": RebalanceConfig.parse,
    }

    def __post_init__(self) -> None:
        check_fields(self, _ROOT.child("scheduler"))

    RENAMED: ClassVar[dict[str, str]] = {"debug_drop_mamba_state": "debug_drop_state"}

    @classmethod
    def from_dict(cls, raw: Any, key: KeyPath = _ROOT.child("scheduler")) -> SchedulerConfig:
        return cls(**parse_fields(cls, rename_deprecated(raw, key, cls.RENAMED), key))

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.CHECKS}
        out["rebalance"] = self.rebalance.to_dict()
        return out


@dataclass(frozen=True)
class StateCacheConfig(Section):
    """Prefix reuse (`raysched.state_cache`, `raysched.prefix_cache`): states at every prefill
    chunk boundary, branch point, prompt point (the last grid point before the prompt's end) and
    finished turn parked in the object store (K/V in blocks, once), restored by a later request
    whose prompt starts with their tokens."""

    enabled: bool = True
    budget_bytes: int | None = None  # parked bytes kept; None = a quarter of the scheduler
    #   node's object store
    min_tokens: int = 64  # states covering fewer tokens are not parked
    inline_budget_bytes: int = 8 << 20  # of which states under Ray's inline-return size (100 KiB),
    #   which live in the scheduler's own memory, not the object store
    placement_slack: float = 0.25  # a request goes to the worker holding its matched state when
    #   that worker's free fraction is within this of the roomiest worker's
    turn_points: bool = True  # park each prompt's end and each finished turn too (a chat's next
    #   turn resends the history); false for single-turn traffic: only what prompts share is parked
    turn_window: int = 64  # while the last this many turn points parked got no hit, park none
    #   (and drop those without hits) until a prompt that contains an earlier one whole (a repeat,
    #   a next turn) comes; 0: always park them
    late_branch_calls: int = 2  # a worker's last prefill calls whose scan-grid states it keeps, so
    #   a branch point found after an earlier prompt's prefill passed it is still parked from
    #   them (0: off; costs memory, about the call's tokens / grid x one recurrent state)

    KEY: ClassVar[KeyPath] = _ROOT.child("state_cache")
    CHECKS: ClassVar[dict[str, Check]] = {
        "enabled": check_bool,
        "budget_bytes": check_optional(check_non_negative_int),
        "min_tokens": check_positive_int,
        "inline_budget_bytes": check_non_negative_int,
        "placement_slack": check_fraction,
        "turn_points": check_bool,
        "turn_window": check_non_negative_int,
        "late_branch_calls": check_non_negative_int,
    }


@dataclass(frozen=True)
class SimConfig(Section):
    """The simulated data plane (`data_plane: sim`, see `actors.sim`): workers that keep the pool
    accounting and the worker interface but run no model. A step call sleeps

        prefill_ms_per_token * prompt tokens fed + decode_steps * (decode_ms + decode_ms_per_row * rows)

    and emits pseudo-tokens, a function of (seed, request id, position)."""

    decode_ms: float = 10.0  # one decode step, fixed part
    decode_ms_per_row: float = 0.0  # one decode step, per running request
    prefill_ms_per_token: float = 0.0
    kv_bytes_per_token: int = 4096  # nominal sizes: pools from pool.memory_bytes, snapshot bytes
    state_bytes: int = 1 << 20  # recurrent state per request
    workers_per_process: int = 16  # simulated workers sharing one actor process
    batch_calls: bool = True  # a host's step calls leave and return in batches (`raysched.workers.HostChannel`)
    vocab_size: int = 32000
    max_context: int = 32768

    KEY: ClassVar[KeyPath] = _ROOT.child("sim")
    CHECKS: ClassVar[dict[str, Check]] = {
        "decode_ms": check_non_negative_number,
        "decode_ms_per_row": check_non_negative_number,
        "prefill_ms_per_token": check_non_negative_number,
        "kv_bytes_per_token": check_positive_int,
        "state_bytes": check_positive_int,
        "workers_per_process": check_positive_int,
        "batch_calls": check_bool,
        "vocab_size": check_positive_int,
        "max_context": check_positive_int,
    }

    def step_ms(self, prefill_tokens: int, decode_steps: int, rows: int) -> float:
        """The modeled time of one step call."""
        return self.prefill_ms_per_token * prefill_tokens + decode_steps * (self.decode_ms + self.decode_ms_per_row * rows)


@dataclass(frozen=True)
class MigrationConfig(Section):
    """Live migration (`raysched.scheduler.migration`): K/V copied in pre-copy stages while the
    request decodes on, then one stop-and-copy (Llumnix's defaults: 16 blocks of 16 tokens,
    at most 3 stages)."""

    block_tokens: int = 16  # a pre-copy stage sends whole blocks of this many tokens
    last_stage_tokens: int = 256  # the stop-and-copy starts once fewer unsent tokens than this
    #   remain (0: never; every migration falls back to snapshot mode after `max_stages`)
    max_stages: int = 3  # pre-copy stages before falling back to a blocking snapshot copy

    KEY: ClassVar[KeyPath] = _ROOT.child("migration")
    CHECKS: ClassVar[dict[str, Check]] = {
        "block_tokens": check_positive_int,
        "last_stage_tokens": check_non_negative_int,
        "max_stages": check_positive_int,
    }


@dataclass(frozen=True)
class FaultSpec:
    """An injected fault, fired once worker `worker` has run `after_steps` calls.

    Between calls (the scheduler does it): kill_worker: the worker actor is killed. remove_node:
    every worker on that worker's node is killed (what the scheduler sees when a node is lost).
    Both wait, past `after_steps`, for a call that leaves a request's state on the worker.
    corrupt_snapshot: one byte of the next snapshot taken from that worker is flipped (its resume
    must be refused and recomputed). kill_scheduler: the scheduler actor itself dies; without
    `worker` it counts the scheduler's own calls (to all its workers together), with one that
    worker's calls.

    Inside a call (the worker's process exits there, told by a `FaultPoint` in the call):
    kill_in_step: in the worker's next call with at least `after_decode_steps` decode steps (and
    one), after that many of them
    (with `pipelined`, in its next pipelined call: one sent before the call ahead of it returned;
    with `folded`, in its next folded call: one that runs its successor's steps too).
    kill_in_join: in the worker's next folded call, right after it fed a chunk of a prompt that
    joined it (`Worker.join`) while the rest of that prompt is still to be fed.
    kill_in_retract: in its next retract call, after the
    gather, before the return. kill_in_restore: in its next call that restores a snapshot (with
    `cross_node`, one taken on another node), right after the restore.
    """

    kind: str  # one of FAULT_KINDS
    worker: int | None  # index of the worker, in [0, workers); kill_scheduler: optional (see below)
    after_steps: int  # worker calls before the fault fires (or is armed, for the kill_in_* kinds)
    after_decode_steps: int = 0  # kill_in_step only
    cross_node: bool = False  # kill_in_restore only
    pipelined: bool = False  # kill_in_step only
    folded: bool = False  # kill_in_step only
    stage: int = 1  # kill_migration_* only: the pre-copy stage (1 = the first)
    final: bool = False  # kill_migration_* only: in the stop-and-copy instead of a pre-copy stage

    CHECKS: ClassVar[dict[str, Check]] = {
        "kind": check_one_of(FAULT_KINDS),
        "worker": check_optional(check_non_negative_int),
        "after_steps": check_non_negative_int,
        "after_decode_steps": check_non_negative_int,
        "cross_node": check_bool,
        "pipelined": check_bool,
        "folded": check_bool,
        "stage": check_positive_int,
        "final": check_bool,
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("kind", "worker", "after_steps")
    WORKER_OPTIONAL: ClassVar[tuple[str, ...]] = ("kill_scheduler",)  # kinds that need no `worker`
    ONLY_FOR: ClassVar[dict[str, tuple[str, object]]] = {  # option -> (the kind it applies to, default)
        "after_decode_steps": ("kill_in_step", 0), "pipelined": ("kill_in_step", False),
        "folded": ("kill_in_step", False),
        "cross_node": ("kill_in_restore", False), "stage": (MIGRATION_KILLS, 1), "final": (MIGRATION_KILLS, False)}

    def __post_init__(self) -> None:
        check_fields(self, _ROOT.child("fault"))
        _check_fault_options(self.kind, vars(self), _ROOT.child("fault"))
        if self.worker is None and self.kind not in self.WORKER_OPTIONAL:
            raise _ROOT.child("fault").error(f"is missing required key(s): worker (kind {self.kind})")

    @classmethod
    def from_dict(cls, raw: Any, key: KeyPath = _ROOT.child("fault")) -> FaultSpec:
        values = parse_fields(cls, raw, key)
        optional = ("worker",) if values.get("kind") in cls.WORKER_OPTIONAL else ()
        missing = [name for name in cls.REQUIRED if name not in values and name not in optional]
        if missing:
            raise key.error(f"is missing required key(s): {', '.join(missing)}")
        _check_fault_options(values["kind"], values, key)
        return cls(**{"worker": None, **values})

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "after_steps": self.after_steps}
        if self.worker is not None:
            out["worker"] = self.worker
        out.update({name: getattr(self, name) for name, (kind, _) in self.ONLY_FOR.items() if _owns(kind, self.kind)})
        return out


def _check_fault_options(kind: str, values: Mapping[str, Any], key: KeyPath) -> None:
    """An option of another fault kind set to a non-default value is an error, not ignored."""
    for name, (owner, default) in FaultSpec.ONLY_FOR.items():
        if not _owns(owner, kind) and values.get(name, default) != default:
            names = owner if isinstance(owner, str) else " or ".join(owner)
            raise key.child(name).error(f"applies only to kind {names}, not {kind}")


def _owns(owner: str | tuple[str, ...], kind: str) -> bool:
    """Whether an option owned by `owner` (a kind, or several) applies to `kind`."""
    return kind == owner if isinstance(owner, str) else kind in owner


FaultConfig: TypeAlias = tuple[FaultSpec, ...]  # the `faults:` list of a serve config


@dataclass(frozen=True)
class RolesConfig(Section):
    """Disaggregated serving (`raysched.scheduler.roles`): `prefill` workers take new prompts
    and hand each request, once its prompt is prefilled and its first token sampled, to one of
    the `decode` workers. Absent (the default): every worker does both."""

    prefill: int
    decode: int

    KEY: ClassVar[KeyPath] = _ROOT.child("roles")
    CHECKS: ClassVar[dict[str, Check]] = {"prefill": check_positive_int, "decode": check_positive_int}
    REQUIRED: ClassVar[tuple[str, ...]] = ("prefill", "decode")
    OPTIONAL: ClassVar[bool] = True  # absent: every worker does both

    @property
    def workers(self) -> int:
        return self.prefill + self.decode



@dataclass(frozen=True)
class AutoscaleConfig(Section):
    """The elastic worker set on its own (`raysched.scheduler.autoscale`): grow by one worker when
    at least `scale_up_waiting` requests per live worker have waited for `scale_up_after_s`
    (asking Ray for its resources first, so an autoscaling cluster adds a node); drain and remove a
    worker that has held nothing, with nothing waiting, for `scale_down_idle_s`. Absent (the
    default): the set stays as `workers` says."""

    max_workers: int
    min_workers: int = 1
    scale_up_waiting: int = 4  # waiting requests per live worker that count as pressure
    scale_up_after_s: float = 2.0  # pressure must last this long before a grow
    scale_down_idle_s: float = 30.0  # a worker idle this long (nothing running, nothing waiting) goes
    interval_s: float = 0.5  # how often the load is looked at

    KEY: ClassVar[KeyPath] = _ROOT.child("autoscale")
    CHECKS: ClassVar[dict[str, Check]] = {
        "max_workers": check_positive_int,
        "min_workers": check_positive_int,
        "scale_up_waiting": check_positive_int,
        "scale_up_after_s": check_non_negative_number,
        "scale_down_idle_s": check_non_negative_number,
        "interval_s": check_finite_number,
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("max_workers",)
    OPTIONAL: ClassVar[bool] = True  # absent: a fixed set

    def __post_init__(self) -> None:
        super().__post_init__()
        key = self.KEY
        if self.max_workers < self.min_workers:
            raise key.child("max_workers").error(
                f"must be >= autoscale.min_workers ({self.min_workers}), got {self.max_workers}")
        if self.interval_s <= 0:
            raise key.child("interval_s").error(f"must be > 0, got {self.interval_s}")



def _check_instance(cls: type) -> Check:
    def check(value: Any, key: KeyPath) -> Any:
        if not isinstance(value, cls):
            raise key.error(f"must be a {cls.__name__}, got {type(value).__name__}")
        return value

    return check


def _check_faults(value: Any, key: KeyPath) -> FaultConfig:
    if not isinstance(value, tuple) or not all(isinstance(f, FaultSpec) for f in value):
        raise key.error(f"must be a tuple of FaultSpec, got {value!r}")
    return value


def _parse_faults(raw: Any, key: KeyPath) -> FaultConfig:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise key.error(f"must be a list of faults, got {_describe(raw)}")
    return tuple(FaultSpec.from_dict(item, key.item(i)) for i, item in enumerate(raw))


@dataclass(frozen=True)
class ServeConfig:
    """Everything a serving run needs besides the workload.

    >>> cfg = load_serve_config({"workers": 3, "pool": {"kv_tokens": 256}})
    >>> cfg.workers, cfg.pool.kv_tokens, cfg.pool.state_slots, cfg.scheduler.retract
    (3, 256, 8, 'snapshot')
    """

    model: str = "tiny"  # preset name or local checkpoint directory
    dtype: str = "float32"  # float32 | bfloat16
    workers: int = 2  # engine actors
    device: str = "auto"  # auto | cuda | cpu
    seed: int = 0
    pool: PoolConfig = PoolConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    state_cache: StateCacheConfig = StateCacheConfig()
    migration: MigrationConfig = MigrationConfig()
    faults: FaultConfig = ()
    roles: RolesConfig | None = None  # prefill / decode workers; None: every worker does both
    autoscale: AutoscaleConfig | None = None  # grow / shrink the worker set; None: fixed at `workers`
    object_store_memory: int | None = None  # bytes, for the embedded Ray cluster
    invariant_tile: int = 16  # rows per matrix-kernel call in batch-invariant decode
    fixed_shape_decode: bool | None = None  # decode at bucket shapes, CUDA graphs (null: on CUDA)
    data_plane: str = "torch"  # torch: the model | sim: simulated workers (`sim`, `actors.sim`)
    sim: SimConfig = SimConfig()

    CHECKS: ClassVar[dict[str, Check]] = {
        "model": check_nonempty_str,
        "dtype": check_one_of(DTYPES),
        "workers": check_positive_int,
        "device": check_one_of(DEVICES),
        "seed": check_seed,
        "pool": _check_instance(PoolConfig),
        "scheduler": _check_instance(SchedulerConfig),
        "state_cache": _check_instance(StateCacheConfig),
        "migration": _check_instance(MigrationConfig),
        "faults": _check_faults,
        "roles": check_optional(_check_instance(RolesConfig)),
        "autoscale": check_optional(_check_instance(AutoscaleConfig)),
        "object_store_memory": check_optional(check_positive_int),
        "invariant_tile": check_positive_int,
        "fixed_shape_decode": check_optional(check_bool),
        "data_plane": check_one_of(DATA_PLANES),
        "sim": _check_instance(SimConfig),
    }
    PARSERS: ClassVar[dict[str, Check]] = {
        "pool": PoolConfig.from_dict,
        "scheduler": SchedulerConfig.from_dict,
        "state_cache": StateCacheConfig.from_dict,
        "migration": MigrationConfig.from_dict,
        "faults": _parse_faults,
        "sim": SimConfig.from_dict,
        "roles": RolesConfig.from_dict,
        "autoscale": AutoscaleConfig.from_dict,
    }

    def __post_init__(self) -> None:
        check_fields(self, _ROOT)
        if self.roles is not None and self.roles.workers != self.workers:
            raise _ROOT.child("roles").error(f"prefill + decode ({self.roles.workers}) must equal workers "
                                             f"({self.workers}); leave workers out to take it from roles")
        for i, fault in enumerate(self.faults):
            if fault.worker is not None and fault.worker >= self.workers:
                raise _ROOT.child("faults").item(i).child("worker").error(
                    f"must be < workers ({self.workers}), got {fault.worker}")
            if fault.pipelined and self.scheduler.fold_successor:
                raise _ROOT.child("faults").item(i).child("pipelined").error(
                    "needs scheduler.fold_successor: false (folded successors are never a second call)")
            if fault.folded and not self.scheduler.fold_successor:
                raise _ROOT.child("faults").item(i).child("folded").error(
                    "needs scheduler.fold_successor: true (no call is folded without it)")
        if self.data_plane != "sim" and self.sim != SimConfig():
            raise _ROOT.child("sim").error(f"applies only to data_plane: sim, not {self.data_plane}")
        if self.autoscale is not None:
            _check_autoscale_fits(self.autoscale, self.workers, self.roles)

    @classmethod
    def from_dict(cls, raw: Any) -> ServeConfig:
        mapping = check_mapping(raw, _ROOT, cls.CHECKS)
        values = {name: cls.PARSERS.get(name, cls.CHECKS[name])(value, _ROOT.child(name))
                  for name, value in mapping.items()}
        if values.get("roles") is not None and "workers" not in values:  # workers follow the roles
            values["workers"] = values["roles"].workers
        if values.get("autoscale") is not None and "workers" not in values:  # start at the floor
            values["workers"] = values["autoscale"].min_workers
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON data; ``load_serve_config(cfg.to_dict()) == cfg``."""
        out = {name: getattr(self, name) for name in self.CHECKS}
        out["pool"] = self.pool.to_dict()
        out["scheduler"] = self.scheduler.to_dict()
        out["state_cache"] = self.state_cache.to_dict()
        out["migration"] = self.migration.to_dict()
        out["faults"] = [fault.to_dict() for fault in self.faults]
        out["sim"] = self.sim.to_dict()
        out["roles"] = self.roles.to_dict() if self.roles is not None else None
        out["autoscale"] = self.autoscale.to_dict() if self.autoscale is not None else None
        return out


def _check_autoscale_fits(autoscale: AutoscaleConfig, workers: int, roles: RolesConfig | None) -> None:
    """The starting set lies within the autoscale bounds; roles and autoscale do not mix (an
    added worker would do both)."""
    key = _ROOT.child("autoscale")
    if roles is not None:
        raise key.error("cannot be combined with roles (an added worker would both prefill and decode)")
    if not autoscale.min_workers <= workers <= autoscale.max_workers:
        raise _ROOT.child("workers").error(
            f"must lie within autoscale.min_workers..max_workers ({autoscale.min_workers}.."
            f"{autoscale.max_workers}), got {workers}")


def load_serve_config(path_or_dict: PathOrDict) -> ServeConfig:
    """Load and validate a serve config from a YAML file path or a dict.

    Absent keys take their defaults; an unknown key, a wrong type or a bad value raises
    ConfigError naming the key path.

    >>> load_serve_config({"scheduler": {"retract": "recompute"}}).scheduler.retract
    'recompute'
    >>> load_serve_config({"pool": {"kv_tokenz": 64}})
    Traceback (most recent call last):
    ...
    raysched.config.ConfigError: serve config: unknown key 'pool.kv_tokenz' (did you mean 'kv_tokens'?)
    """
    return ServeConfig.from_dict(read_config_source(path_or_dict, _SOURCE))


PRESET_NAMES = ("tiny", "small", "tiny-granite", "tiny-nemotronh", "tiny-qwen35", "tiny-qwen3next")  # actors.presets
CHECKPOINT_CONFIG_FILE = "config.json"  # what makes a directory a checkpoint (actors.loader)


def check_model_source(model: str, local: bool = True) -> None:
    """Raise ConfigError unless `model` is a preset or a directory holding a checkpoint's
    `config.json`: checked before Ray starts, so a mistyped path is one line, not a worker's
    traceback. `local=False` (attaching to a cluster whose workers may have the checkpoint where
    this machine has none) skips the check: the workers check it when they start."""
    if not local or model in PRESET_NAMES:
        return
    path = Path(model)
    if not path.is_dir():
        raise ConfigError(f"serve config: model {model!r} is neither a preset ({', '.join(PRESET_NAMES)}) "
                          f"nor a directory")
    if not (path / CHECKPOINT_CONFIG_FILE).is_file():
        raise ConfigError(f"serve config: model {model!r} is a directory without {CHECKPOINT_CONFIG_FILE} "
                          f"(a checkpoint as transformers' save_pretrained writes it)")
