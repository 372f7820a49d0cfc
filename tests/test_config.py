"""The serve config: YAML in, frozen validated dataclasses out; every bad input names its key."""

from __future__ import annotations

import dataclasses
import doctest
import re
from pathlib import Path

import pytest

import raysched.config
from raysched.config import (
    ConfigError,
    FaultSpec,
    PoolConfig,
    SchedulerConfig,
    ServeConfig,
    load_serve_config,
)

REPO = Path(__file__).resolve().parents[1]

BRIEF_EXAMPLE = """\
model: tiny
dtype: float32
workers: 2
device: auto
pool:
  kv_tokens: 512
  state_slots: 8
scheduler:
  retract: snapshot
"""


def write(tmp_path: Path, text: str, name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------- good input


def test_brief_example_yaml_loads_with_defaults_for_the_rest(tmp_path: Path) -> None:
    cfg = load_serve_config(write(tmp_path, BRIEF_EXAMPLE))
    assert cfg == ServeConfig()
    assert cfg.pool == PoolConfig(kv_tokens=512, state_slots=8)
    assert cfg.scheduler.victim_order == "fewest_generated"
    assert cfg.faults == ()


def test_demo_yaml_loads_with_small_pools() -> None:
    cfg = load_serve_config(REPO / "examples" / "demo.yaml")
    assert (cfg.model, cfg.workers) == ("tiny", 2)
    assert (cfg.pool.kv_tokens, cfg.pool.state_slots) == (160, 4)
    assert (cfg.scheduler.retract, cfg.scheduler.decode_steps_per_call) == ("snapshot", 4)


def _kv_tokens_needed(model: str, chars: int, max_tokens: int = 16) -> int:
    """KV tokens one request of `chars` characters of English text and `max_tokens` needs (the
    server's own sum: prompt + max_tokens - 1, the last token's K/V is never written)."""
    from raysched.tokenizer import require_tokenizer

    words = "the scheduler moves each request with its whole state to any worker of the cluster".split()
    text = " ".join(words[i % len(words)] for i in range(chars))[:chars]
    return len(require_tokenizer(model).encode(text)) + max_tokens - 1


@pytest.mark.parametrize("name", ["serve", "demo"], ids=["serve-holds-it", "control-demo-does-not"])
def test_serve_yaml_holds_a_2000_character_prompt_and_the_demo_yaml_does_not(name: str) -> None:
    """The README's serve config takes a real prompt (2,000 characters, with room for four such
    requests per worker and prefix reuse on); the demo's pools are sized to overflow."""
    cfg = load_serve_config(REPO / "examples" / f"{name}.yaml")
    need = _kv_tokens_needed(cfg.model, 2000)
    if name == "serve":
        assert 4 * need <= cfg.pool.kv_tokens and cfg.pool.state_slots >= 8 and cfg.state_cache.enabled, need
    else:
        assert need > cfg.pool.kv_tokens, need


def test_path_given_as_str_loads(tmp_path: Path) -> None:
    assert load_serve_config(str(write(tmp_path, "workers: 3\n"))).workers == 3


def test_empty_file_means_all_defaults(tmp_path: Path) -> None:
    assert load_serve_config(write(tmp_path, "# nothing here\n")) == ServeConfig()


def test_yaml_null_section_means_section_defaults() -> None:
    assert load_serve_config({"pool": None, "faults": None}) == ServeConfig()


def test_every_field_parses_from_yaml(tmp_path: Path) -> None:
    text = """\
model: /ckpt/bamba
dtype: bfloat16
workers: 3
device: cuda
seed: 11
object_store_memory: 2000000000
invariant_tile: 16
fixed_shape_decode: false
pool: {kv_tokens: 64, state_slots: 2, page_size: 16}
scheduler:
  retract: auto
  admission: reserve
  victim_order: largest_memory
  decode_steps_per_call: 1
  force_retract_every: 5
  max_retractions: 0
  debug_drop_state: true
  max_batch_size: 2
faults:
  - {kind: kill_worker, worker: 1, after_steps: 10}
  - {kind: remove_node, worker: 2, after_steps: 0}
"""
    cfg = load_serve_config(write(tmp_path, text))
    assert cfg.dtype == "bfloat16" and cfg.object_store_memory == 2_000_000_000
    assert cfg.fixed_shape_decode is False
    assert cfg.pool == PoolConfig(kv_tokens=64, state_slots=2, page_size=16)
    assert cfg.scheduler == SchedulerConfig(retract="auto", admission="reserve", victim_order="largest_memory",
                                            decode_steps_per_call=1, force_retract_every=5, max_retractions=0,
                                            debug_drop_state=True, max_batch_size=2)
    assert cfg.faults == (FaultSpec("kill_worker", 1, 10), FaultSpec("remove_node", 2, 0))


def test_to_dict_round_trips_through_the_loader() -> None:
    cfg = load_serve_config({"workers": 3, "faults": [{"kind": "kill_worker", "worker": 2, "after_steps": 4}],
                             "pool": {"memory_bytes": 10_000, "state_slots": 2}})
    assert load_serve_config(cfg.to_dict()) == cfg
    assert load_serve_config(ServeConfig().to_dict()) == ServeConfig()


def test_configs_are_frozen_and_replace_builds_a_new_one() -> None:
    cfg = ServeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers = 4  # type: ignore[misc]
    assert dataclasses.replace(cfg, workers=4).workers == 4
    assert cfg.workers == 2


# ---------------------------------------------------------------------------- bad input


def test_unknown_nested_key_names_path_and_suggests_closest() -> None:
    with pytest.raises(ConfigError) as e:
        load_serve_config({"pool": {"kv_tokenz": 64}})
    assert str(e.value) == "serve config: unknown key 'pool.kv_tokenz' (did you mean 'kv_tokens'?)"


def test_unknown_top_level_key_suggests_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'workrs' \(did you mean 'workers'\?\)"):
        load_serve_config({"workrs": 2})


def test_unknown_key_without_close_match_lists_known_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'scheduler.zzz' \(known: .*max_retractions"):
        load_serve_config({"scheduler": {"zzz": 1}})


def test_negative_number_names_key_and_value() -> None:
    with pytest.raises(ConfigError) as e:
        load_serve_config({"pool": {"kv_tokens": -3}})
    assert str(e.value) == "serve config: pool.kv_tokens must be a positive integer, got -3"


def test_wrong_type_string_for_int_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^serve config: workers must be a positive integer, got 'two'$"):
        load_serve_config({"workers": "two"})


def test_float_for_int_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"scheduler.decode_steps_per_call must be a positive integer, got 2.5"):
        load_serve_config({"scheduler": {"decode_steps_per_call": 2.5}})


def test_bool_for_int_is_rejected() -> None:
    with pytest.raises(ConfigError, match="pool.state_slots must be a positive integer, got True"):
        load_serve_config({"pool": {"state_slots": True}})


def test_join_keys_are_validated() -> None:
    cfg = load_serve_config({"scheduler": {"join_long_calls": False, "join_after_ms": 0}})
    assert cfg.scheduler.join_long_calls is False and cfg.scheduler.join_after_ms == 0
    with pytest.raises(ConfigError, match="scheduler.join_after_ms must be a finite number >= 0, got -1"):
        load_serve_config({"scheduler": {"join_after_ms": -1}})
    with pytest.raises(ConfigError, match="scheduler.join_long_calls must be true or false, got 'yes'"):
        load_serve_config({"scheduler": {"join_long_calls": "yes"}})


def test_max_worker_failures_defaults_to_three_and_is_validated() -> None:
    assert load_serve_config({}).scheduler.max_worker_failures == 3
    cfg = load_serve_config({"scheduler": {"max_worker_failures": 1}})
    assert cfg.scheduler.max_worker_failures == 1 and load_serve_config(cfg.to_dict()) == cfg
    for bad in (0, -2, 2.5, True, "3"):
        with pytest.raises(ConfigError, match=f"scheduler.max_worker_failures must be a positive integer, got {bad!r}"):
            load_serve_config({"scheduler": {"max_worker_failures": bad}})


def test_int_for_bool_is_rejected() -> None:
    with pytest.raises(ConfigError, match="scheduler.debug_drop_state must be true or false, got 1"):
        load_serve_config({"scheduler": {"debug_drop_state": 1}})


def test_bad_enum_value_lists_choices_and_suggests() -> None:
    with pytest.raises(ConfigError) as e:
        load_serve_config({"scheduler": {"retract": "snapshott"}})
    assert str(e.value) == ("serve config: scheduler.retract must be one of snapshot | recompute | auto,"
                            " got 'snapshott' (did you mean 'snapshot'?)")


def test_fixed_shape_decode_must_be_a_bool_or_null() -> None:
    assert load_serve_config({"fixed_shape_decode": None}).fixed_shape_decode is None
    with pytest.raises(ConfigError, match="fixed_shape_decode"):
        load_serve_config({"fixed_shape_decode": "yes"})


def test_bad_dtype_is_rejected() -> None:
    with pytest.raises(ConfigError, match=re.escape("serve config: dtype must be one of float32 | bfloat16, got 'fp16'")):
        load_serve_config({"dtype": "fp16"})


def test_negative_seed_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"serve config: seed must be an integer in \[0, 2\*\*64\), got -1"):
        load_serve_config({"seed": -1})


def test_section_that_is_not_a_mapping_is_rejected() -> None:
    with pytest.raises(ConfigError, match="serve config: pool must be a mapping, got 5"):
        load_serve_config({"pool": 5})


def test_top_level_list_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="serve config: must be a mapping"):
        load_serve_config(write(tmp_path, "- workers: 2\n"))


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "model: tiny\npool:\n  kv_tokens: [1, 2\nworkers: 2\n")
    with pytest.raises(ConfigError, match=re.escape(f"serve config: {path}:4: malformed YAML")):
        load_serve_config(path)


def test_duplicate_yaml_key_is_rejected_with_line(tmp_path: Path) -> None:
    path = write(tmp_path, "workers: 2\nmodel: tiny\nworkers: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:3: malformed YAML: duplicate key 'workers'")):
        load_serve_config(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="serve config: cannot read .*nope.yaml"):
        load_serve_config(tmp_path / "nope.yaml")


def test_kv_tokens_must_be_a_multiple_of_page_size() -> None:
    with pytest.raises(ConfigError, match=r"pool.kv_tokens must be a multiple of pool.page_size \(16\), got 100"):
        load_serve_config({"pool": {"kv_tokens": 100, "page_size": 16}})


def test_fault_with_bad_kind_names_its_index() -> None:
    faults = [{"kind": "kill_worker", "worker": 0, "after_steps": 1}, {"kind": "kill", "worker": 0, "after_steps": 1}]
    message = ("serve config: faults[1].kind must be one of kill_worker | remove_node | corrupt_snapshot | "
               "kill_in_step | kill_in_join | kill_in_retract | kill_in_restore | kill_scheduler | "
               "kill_migration_source | kill_migration_dest | refuse_migration, got 'kill'")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_serve_config({"faults": faults})


def test_fault_missing_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"faults\[0\] is missing required key\(s\): after_steps"):
        load_serve_config({"faults": [{"kind": "kill_worker", "worker": 0}]})


def test_kill_scheduler_needs_no_worker_and_counts_the_schedulers_calls() -> None:
    """A scheduler fault has no worker to name: without `worker` it fires once the scheduler
    has made `after_steps` calls to all its workers together; every other kind needs one."""
    from raysched.faults import FaultInjector

    cfg = load_serve_config({"faults": [{"kind": "kill_scheduler", "after_steps": 5}]})
    assert cfg.faults == (FaultSpec("kill_scheduler", None, 5),)
    assert load_serve_config(cfg.to_dict()) == cfg and "worker" not in cfg.faults[0].to_dict()
    injector = FaultInjector(cfg.faults)
    assert injector.due_between_calls(worker=0, call=4, scheduler_calls=4) == []
    assert injector.due_between_calls(worker=1, call=1, scheduler_calls=5) == [cfg.faults[0]]
    assert injector.due_between_calls(worker=0, call=9, scheduler_calls=9) == []  # fires once
    with pytest.raises(ConfigError, match=r"faults\[0\] is missing required key\(s\): worker"):
        load_serve_config({"faults": [{"kind": "kill_worker", "after_steps": 1}]})


def test_a_worker_kill_waits_for_a_call_that_leaves_state_on_the_worker() -> None:
    """A worker that holds nothing (its only request was just dropped for recompute) has nothing
    to lose: its kill waits for its next call that carries a request, so a rehearsal always
    tests a recovery. Control: a corrupt_snapshot, which kills nothing, does not wait."""
    from raysched.faults import FaultInjector

    cfg = load_serve_config({"faults": [{"kind": "kill_worker", "worker": 1, "after_steps": 3},
                                        {"kind": "corrupt_snapshot", "worker": 0, "after_steps": 3}]})
    injector = FaultInjector(cfg.faults)
    assert injector.due_between_calls(worker=1, call=3, scheduler_calls=6, holding=False) == []
    assert injector.due_between_calls(worker=1, call=4, scheduler_calls=7, holding=True) == [cfg.faults[0]]
    assert injector.due_between_calls(worker=0, call=3, scheduler_calls=8, holding=False) == [cfg.faults[1]]


def test_a_kill_in_step_waits_for_a_call_with_its_decode_steps() -> None:
    """A kill after 2 decode steps of a call does not fire in a call with only one (the worker
    would die after that one, not where the scenario says: seen in a slow-suite run); it fires
    in the worker's next call with two or more. Control: after 0 steps, any call with a decode
    step will do."""
    from raysched.faults import FaultInjector

    cfg = load_serve_config({"faults": [{"kind": "kill_in_step", "worker": 1, "after_steps": 3,
                                         "after_decode_steps": 2},
                                        {"kind": "kill_in_step", "worker": 0, "after_steps": 0}]})
    injector = FaultInjector(cfg.faults)
    assert injector.in_step(worker=1, call=3, decode_steps=1, resume_cross_node=None, pipelined=False) is None
    point = injector.in_step(worker=1, call=4, decode_steps=4, resume_cross_node=None, pipelined=False)
    assert point is not None and point.after_decode_steps == 2
    assert injector.in_step(worker=0, call=0, decode_steps=0, resume_cross_node=None, pipelined=False) is None
    assert injector.in_step(worker=0, call=1, decode_steps=1, resume_cross_node=None, pipelined=False) is not None


def test_fault_options_of_another_kind_are_rejected_not_ignored() -> None:
    fault = {"kind": "kill_in_retract", "worker": 0, "after_steps": 1, "after_decode_steps": 2}
    with pytest.raises(ConfigError, match=r"faults\[0\].after_decode_steps applies only to kind kill_in_step, "
                                          r"not kill_in_retract"):
        load_serve_config({"faults": [fault]})
    with pytest.raises(ConfigError, match=r"fault.cross_node applies only to kind kill_in_restore, not kill_worker"):
        FaultSpec("kill_worker", 0, 1, cross_node=True)
    ok = [{"kind": "kill_in_step", "worker": 1, "after_steps": 3, "after_decode_steps": 2, "pipelined": True,
           "folded": False},
          {"kind": "kill_in_restore", "worker": 0, "after_steps": 0, "cross_node": True}]
    with pytest.raises(ConfigError, match=r"faults\[0\].pipelined needs scheduler.fold_successor: false"):
        load_serve_config({"faults": ok})  # folded successors are never a second call: it could not fire
    cfg = load_serve_config({"faults": ok, "scheduler": {"fold_successor": False}})
    assert cfg.faults == (FaultSpec("kill_in_step", 1, 3, after_decode_steps=2, pipelined=True),
                          FaultSpec("kill_in_restore", 0, 0, cross_node=True))
    assert [f.to_dict() for f in cfg.faults] == ok  # round trip, options of other kinds left out


def test_fault_on_a_worker_that_does_not_exist_is_rejected() -> None:
    fault = {"kind": "remove_node", "worker": 2, "after_steps": 3}
    with pytest.raises(ConfigError, match=r"faults\[0\].worker must be < workers \(2\), got 2"):
        load_serve_config({"faults": [fault]})


def test_faults_must_be_a_list() -> None:
    with pytest.raises(ConfigError, match="serve config: faults must be a list of faults"):
        load_serve_config({"faults": {"kind": "kill_worker"}})


def test_direct_construction_is_validated_like_yaml() -> None:
    with pytest.raises(ConfigError, match="serve config: pool.kv_tokens must be a positive integer, got -3"):
        PoolConfig(kv_tokens=-3)
    with pytest.raises(ConfigError, match="serve config: workers must be a positive integer, got 0"):
        dataclasses.replace(ServeConfig(), workers=0)


def test_loader_rejects_a_non_path_non_dict() -> None:
    with pytest.raises(ConfigError, match="expected a YAML path or a dict, got int"):
        load_serve_config(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- byte budgets


def test_budget_without_counts_reserves_default_slots_and_gives_the_rest_to_kv() -> None:
    pool = load_serve_config({"pool": {"memory_bytes": 10_000}}).pool
    sized = pool.resolve(kv_bytes_per_token=10, state_bytes_per_slot=360)
    assert (sized.kv_tokens, sized.state_slots) == (712, 8)  # 8 * 360 + 712 * 10 = 10_000


def test_budget_with_explicit_state_slots_gives_the_rest_to_kv() -> None:
    pool = load_serve_config({"pool": {"memory_bytes": 10_000, "state_slots": 2}}).pool
    sized = pool.resolve(kv_bytes_per_token=10, state_bytes_per_slot=1000)
    assert (sized.kv_tokens, sized.state_slots) == (800, 2)


def test_budget_with_explicit_kv_tokens_gives_the_rest_to_mamba_rounded_to_pages() -> None:
    pool = load_serve_config({"pool": {"memory_bytes": 10_000, "kv_tokens": 96, "page_size": 16}}).pool
    sized = pool.resolve(kv_bytes_per_token=10, state_bytes_per_slot=1000)
    assert (sized.kv_tokens, sized.state_slots) == (96, 9)


def test_budget_with_both_counts_explicit_changes_nothing() -> None:
    pool = load_serve_config({"pool": {"memory_bytes": 100, "kv_tokens": 64, "state_slots": 4}}).pool
    assert pool.resolve(kv_bytes_per_token=10, state_bytes_per_slot=1000) is pool


def test_no_budget_means_resolve_returns_the_same_pool() -> None:
    pool = PoolConfig(kv_tokens=32)
    assert pool.resolve(kv_bytes_per_token=10, state_bytes_per_slot=10) is pool


def test_resolve_is_idempotent() -> None:
    sized = PoolConfig(memory_bytes=10_000, page_size=8, kv_tokens=8).resolve(10, 360)
    assert sized.kv_tokens % 8 == 0
    assert sized.resolve(10, 360) == sized


def test_budget_too_small_for_the_default_slots_is_a_config_error() -> None:
    message = "serve config: pool.memory_bytes = 8000 B cannot hold 8 state slot(s) of 1000 B plus 1 KV token(s)"
    with pytest.raises(ConfigError, match=re.escape(message)):
        PoolConfig(memory_bytes=8000).resolve(kv_bytes_per_token=10, state_bytes_per_slot=1000)


def test_budget_too_small_beside_explicit_kv_tokens_is_a_config_error() -> None:
    pool = load_serve_config({"pool": {"memory_bytes": 1500, "kv_tokens": 100}}).pool
    with pytest.raises(ConfigError, match=re.escape("cannot hold 1 state slot(s) of 1000 B plus 100 KV token(s)")):
        pool.resolve(kv_bytes_per_token=10, state_bytes_per_slot=1000)


# ---------------------------------------------------------------------------- docs


def test_docstring_examples_run() -> None:
    result = doctest.testmod(raysched.config)
    assert result.attempted > 0 and result.failed == 0


def test_old_key_names_keep_working_with_a_one_line_notice(caplog) -> None:
    with caplog.at_level("WARNING", logger="raysched.config"):
        cfg = load_serve_config({"pool": {"mamba_slots": 3}, "scheduler": {"debug_drop_mamba_state": True}})
    assert cfg.pool.state_slots == 3 and cfg.scheduler.debug_drop_state is True
    notices = [r.getMessage() for r in caplog.records]
    assert notices == ["serve config: pool.mamba_slots is deprecated; call it pool.state_slots",
                       "serve config: scheduler.debug_drop_mamba_state is deprecated; call it scheduler.debug_drop_state"]


def test_old_and_new_key_name_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match="pool.mamba_slots is the old name of pool.state_slots; give only one"):
        load_serve_config({"pool": {"mamba_slots": 3, "state_slots": 4}})


def test_migration_and_rebalance_sections_are_typed_and_round_trip() -> None:
    cfg = load_serve_config({"migration": {"block_tokens": 8, "max_stages": 2},
                             "scheduler": {"rebalance": {"enabled": True, "threshold": 0.3}}})
    assert (cfg.migration.block_tokens, cfg.scheduler.rebalance.threshold) == (8, 0.3)
    assert load_serve_config(cfg.to_dict()) == cfg
    for raw, message in [({"migration": {"max_stages": 0}}, "migration.max_stages must be a positive integer"),
                         ({"scheduler": {"rebalance": {"enabeld": True}}}, "unknown key 'scheduler.rebalance.enabeld'"),
                         ({"scheduler": {"rebalance": {"interval_s": 0}}}, "scheduler.rebalance.interval_s must be > 0"),
                         ({"faults": [{"kind": "kill_worker", "worker": 0, "after_steps": 0, "final": True}]},
                          "faults[0].final applies only to kind kill_migration_source or kill_migration_dest")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_serve_config(raw)
