"""Workloads: seeded synthetic requests are reproducible; traces are checked line by line."""

from __future__ import annotations

import dataclasses
import doctest
import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

import raysched.workload
from raysched.config import ConfigError
from raysched.sampling import RequestError, SamplingParams
from raysched.workload import (
    RequestSpec,
    SyntheticSampling,
    WorkloadConfig,
    load_workload,
    load_workload_config,
)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 128
SYNTHETIC: dict[str, Any] = {"requests": 10, "seed": 3, "prompt_len": [2, 6], "max_new_tokens": [1, 4]}


def write_trace(tmp_path: Path, lines: list[str], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def trace_workload(tmp_path: Path, lines: list[str]) -> list[RequestSpec]:
    write_trace(tmp_path, lines)
    yaml_path = tmp_path / "workload.yaml"
    yaml_path.write_text("trace: trace.jsonl\n")
    return load_workload(yaml_path, VOCAB)


# ---------------------------------------------------------------------------- synthetic


def test_demo_workload_has_24_requests_within_its_ranges() -> None:
    specs = load_workload(REPO / "examples" / "workload.yaml", VOCAB)
    assert [s.request_id for s in specs] == [f"req-{i:04d}" for i in range(24)]
    assert all(8 <= len(s.prompt_ids) <= 48 for s in specs)
    assert all(16 <= s.sampling.max_new_tokens <= 48 for s in specs)
    assert all(0 <= t < VOCAB for s in specs for t in s.prompt_ids)
    assert all(s.arrival_s == 0.0 for s in specs)


def test_demo_workload_samples_exactly_half_with_its_own_seeds() -> None:
    specs = load_workload(REPO / "examples" / "workload.yaml", VOCAB)
    sampled = [s.sampling for s in specs if not s.sampling.is_greedy]
    assert len(sampled) == 12
    assert all((p.temperature, p.top_p) == (0.8, 0.9) for p in sampled)
    assert len({p.seed for p in sampled}) == 12


def test_same_seed_gives_identical_requests() -> None:
    assert load_workload(SYNTHETIC, VOCAB) == load_workload(dict(SYNTHETIC), VOCAB)


def test_different_seed_gives_different_prompts() -> None:
    first = load_workload(SYNTHETIC, VOCAB)
    second = load_workload({**SYNTHETIC, "seed": 4}, VOCAB)
    assert [s.prompt_ids for s in first] != [s.prompt_ids for s in second]


def test_changing_arrivals_or_sampling_keeps_the_prompts() -> None:
    base = load_workload(SYNTHETIC, VOCAB)
    varied = load_workload({**SYNTHETIC, "arrival_rate": 5, "sampling": {"sampled_fraction": 0.3}}, VOCAB)
    assert [s.prompt_ids for s in base] == [s.prompt_ids for s in varied]
    assert [s.sampling.max_new_tokens for s in base] == [s.sampling.max_new_tokens for s in varied]


def test_without_a_sampling_block_every_request_is_greedy() -> None:
    assert all(s.sampling.is_greedy for s in load_workload(SYNTHETIC, VOCAB))


def test_sampling_block_without_fraction_samples_every_request() -> None:
    specs = load_workload({**SYNTHETIC, "sampling": {"temperature": 0.7}}, VOCAB)
    assert all(s.sampling.temperature == 0.7 for s in specs)


def test_poisson_arrivals_increase_with_the_requested_mean_gap() -> None:
    specs = load_workload({"requests": 2000, "seed": 1, "prompt_len": [1, 1], "arrival_rate": 50}, VOCAB)
    times = [s.arrival_s for s in specs]
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.1)


def test_infinite_rate_written_as_yaml_inf_or_string(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("requests: 2\narrival_rate: .inf\n")
    assert load_workload_config(path).arrival_rate == float("inf")
    assert load_workload_config({"requests": 2, "arrival_rate": "inf"}).arrival_rate == float("inf")


def test_unknown_key_names_path_and_suggests() -> None:
    with pytest.raises(ConfigError) as e:
        load_workload({**SYNTHETIC, "prompt_length": [1, 2]}, VOCAB)
    assert str(e.value) == "workload: unknown key 'prompt_length' (did you mean 'prompt_len'?)"


def test_unknown_sampling_key_names_nested_path() -> None:
    with pytest.raises(ConfigError, match=r"workload: unknown key 'sampling.sampled_fracton' \(did you mean"):
        load_workload({**SYNTHETIC, "sampling": {"sampled_fracton": 0.5}}, VOCAB)


def test_prompt_len_with_zero_min_is_rejected() -> None:
    message = "workload: prompt_len must be [min, max] with 1 <= min <= max, got [0, 5]"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_workload({**SYNTHETIC, "prompt_len": [0, 5]}, VOCAB)


def test_range_with_min_above_max_is_rejected() -> None:
    with pytest.raises(ConfigError, match=re.escape("workload: max_new_tokens must be [min, max]")):
        load_workload({**SYNTHETIC, "max_new_tokens": [9, 3]}, VOCAB)


def test_range_that_is_not_a_pair_is_rejected() -> None:
    with pytest.raises(ConfigError, match=re.escape("prompt_len must be [min, max] with 1 <= min <= max, got 8")):
        load_workload({**SYNTHETIC, "prompt_len": 8}, VOCAB)


def test_zero_requests_is_rejected() -> None:
    with pytest.raises(ConfigError, match="workload: requests must be a positive integer, got 0"):
        load_workload({"requests": 0}, VOCAB)


def test_non_positive_arrival_rate_is_rejected() -> None:
    with pytest.raises(ConfigError, match="workload: arrival_rate must be a positive number of requests/s or 'inf', got 0"):
        load_workload({**SYNTHETIC, "arrival_rate": 0}, VOCAB)


def test_arrival_rate_word_other_than_inf_is_rejected() -> None:
    with pytest.raises(ConfigError, match="arrival_rate must be a positive number .* got 'fast'"):
        load_workload({**SYNTHETIC, "arrival_rate": "fast"}, VOCAB)


def test_sampled_fraction_above_one_is_rejected() -> None:
    with pytest.raises(ConfigError, match=re.escape("workload: sampling.sampled_fraction must be in [0, 1], got 1.5")):
        load_workload({**SYNTHETIC, "sampling": {"sampled_fraction": 1.5}}, VOCAB)


def test_sampling_top_p_zero_is_rejected() -> None:
    with pytest.raises(ConfigError, match=re.escape("workload: sampling.top_p must be in (0, 1], got 0")):
        load_workload({**SYNTHETIC, "sampling": {"top_p": 0}}, VOCAB)


def test_neither_requests_nor_trace_is_rejected() -> None:
    with pytest.raises(ConfigError, match="workload: needs exactly one of 'requests' .* or 'trace'"):
        load_workload({"seed": 1}, VOCAB)


def test_trace_combined_with_synthetic_keys_is_rejected() -> None:
    with pytest.raises(ConfigError, match="workload: 'requests' cannot be combined with 'trace'"):
        load_workload({"trace": "t.jsonl", "requests": 3}, VOCAB)


def test_bad_vocab_size_is_rejected() -> None:
    with pytest.raises(ConfigError, match="workload: vocab_size must be a positive integer, got 0"):
        load_workload(SYNTHETIC, 0)


def test_malformed_workload_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("requests: 4\nseed: 1\nprompt_len: [1, 2\n")
    with pytest.raises(ConfigError, match=re.escape(f"workload: {path}:4: malformed YAML")):
        load_workload(path, VOCAB)


def test_workload_config_is_frozen_and_validated_on_replace() -> None:
    config = WorkloadConfig(requests=2, sampling=SyntheticSampling(sampled_fraction=0.5))
    with pytest.raises(ConfigError, match="workload: seed must be an integer"):
        dataclasses.replace(config, seed=-5)


# ---------------------------------------------------------------------------- trace


def test_demo_trace_loads_in_order_of_arrival() -> None:
    specs = load_workload({"trace": "trace.jsonl"}, VOCAB, base_dir=REPO / "examples")
    assert [s.request_id for s in specs] == ["greeting", "req-0001", "req-0002"]
    assert specs[1].sampling == SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=1234)
    assert specs[2].sampling.stop_token_ids == (0,)
    assert [s.arrival_s for s in specs] == [0.0, 0.05, 0.1]


def test_trace_path_is_relative_to_the_workload_file(tmp_path: Path) -> None:
    specs = trace_workload(tmp_path, ['{"prompt_ids": [1, 2], "max_new_tokens": 3}'])
    assert specs == [RequestSpec("req-0000", (1, 2), SamplingParams(max_new_tokens=3), 0.0)]


def test_trace_is_sorted_by_arrival_and_skips_blank_lines(tmp_path: Path) -> None:
    lines = ['{"prompt_ids": [1], "max_new_tokens": 1, "arrival_s": 2}', "", "   ",
             '{"prompt_ids": [2], "max_new_tokens": 1, "arrival_s": 1}']
    specs = trace_workload(tmp_path, lines)
    assert [(s.request_id, s.arrival_s) for s in specs] == [("req-0001", 1.0), ("req-0000", 2.0)]


def test_request_specs_round_trip_through_a_trace(tmp_path: Path) -> None:
    specs = load_workload({**SYNTHETIC, "arrival_rate": 4, "sampling": {"sampled_fraction": 0.5}}, VOCAB)
    write_trace(tmp_path, [json.dumps(s.to_dict()) for s in specs])
    assert load_workload({"trace": "trace.jsonl"}, VOCAB, base_dir=tmp_path) == specs


def test_malformed_jsonl_line_names_file_and_line_number(tmp_path: Path) -> None:
    path = write_trace(tmp_path, ['{"prompt_ids": [1], "max_new_tokens": 1}', "",
                                  '{"prompt_ids": [1], "max_new_tokens": 1,}'])
    with pytest.raises(ConfigError, match=re.escape(f"workload: {path}:3: malformed JSON")):
        load_workload({"trace": str(path)}, VOCAB)


def test_trace_line_that_is_not_an_object_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trace.jsonl:1: expected a JSON object, got list"):
        trace_workload(tmp_path, ["[1, 2, 3]"])


def test_trace_line_unknown_key_suggests(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trace.jsonl:1: unknown key 'promt_ids' \(did you mean 'prompt_ids'\?\)"):
        trace_workload(tmp_path, ['{"promt_ids": [1], "max_new_tokens": 1}'])


def test_trace_line_missing_max_new_tokens_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace.jsonl:1: missing required key 'max_new_tokens'"):
        trace_workload(tmp_path, ['{"prompt_ids": [1]}'])


def test_trace_line_with_empty_prompt_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace.jsonl:2: prompt: must not be empty"):
        trace_workload(tmp_path, ['{"prompt_ids": [1], "max_new_tokens": 1}', '{"prompt_ids": [], "max_new_tokens": 1}'])


def test_trace_line_with_out_of_vocab_id_names_line_and_position(tmp_path: Path) -> None:
    message = f"trace.jsonl:1: prompt: token id at position 1 is {VOCAB}, outside [0, {VOCAB})"
    with pytest.raises(ConfigError, match=re.escape(message)):
        trace_workload(tmp_path, [f'{{"prompt_ids": [0, {VOCAB}], "max_new_tokens": 1}}'])


def test_trace_line_with_zero_max_new_tokens_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace.jsonl:1: sampling: max_new_tokens must be a positive integer, got 0"):
        trace_workload(tmp_path, ['{"prompt_ids": [1], "max_new_tokens": 0}'])


def test_trace_line_with_negative_temperature_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace.jsonl:1: sampling: temperature must be a finite number >= 0"):
        trace_workload(tmp_path, ['{"prompt_ids": [1], "max_new_tokens": 1, "temperature": -1}'])


def test_trace_line_with_negative_arrival_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace.jsonl:1: arrival_s must be >= 0, got -1"):
        trace_workload(tmp_path, ['{"prompt_ids": [1], "max_new_tokens": 1, "arrival_s": -1}'])


def test_trace_with_duplicate_request_ids_is_rejected(tmp_path: Path) -> None:
    line = '{"request_id": "a", "prompt_ids": [1], "max_new_tokens": 1}'
    with pytest.raises(ConfigError, match="trace.jsonl:2: duplicate request_id 'a' \\(first on line 1\\)"):
        trace_workload(tmp_path, [line, line])


def test_empty_trace_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no requests"):
        trace_workload(tmp_path, [""])


def test_missing_trace_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="workload: cannot read trace .*missing.jsonl"):
        load_workload({"trace": "missing.jsonl"}, VOCAB, base_dir=tmp_path)


# ---------------------------------------------------------------------------- specs and docs


def test_request_spec_rejects_negative_arrival() -> None:
    with pytest.raises(RequestError, match="arrival_s must be a finite number >= 0, got -1"):
        RequestSpec("r", (1,), SamplingParams(), -1)


def test_request_spec_validate_checks_the_vocab() -> None:
    with pytest.raises(RequestError, match=re.escape("position 0 is 9, outside [0, 5)")):
        RequestSpec("r", (9,), SamplingParams()).validate(vocab_size=5)


def test_docstring_examples_run() -> None:
    result = doctest.testmod(raysched.workload)
    assert result.attempted > 0 and result.failed == 0


def test_trace_priority_is_read_and_defaults_to_zero(tmp_path: Path) -> None:
    specs = trace_workload(tmp_path, ['{"prompt_ids": [1], "max_new_tokens": 1, "priority": -3}',
                                      '{"prompt_ids": [2], "max_new_tokens": 1}'])
    assert [s.priority for s in specs] == [-3, 0]


@pytest.mark.parametrize("bad", ['"high"', "1.5", "true"])
def test_trace_priority_must_be_an_integer(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match=r"trace.jsonl:1: priority must be an integer"):
        trace_workload(tmp_path, ['{"prompt_ids": [1], "max_new_tokens": 1, "priority": %s}' % bad])
