"""SamplingParams and prompts: invalid requests are refused with the field and value named."""

from __future__ import annotations

import dataclasses
import doctest
import json
import math
import re

import pytest

import raysched.sampling
from raysched.sampling import RequestError, SamplingParams, validate_prompt


# ---------------------------------------------------------------------------- good input


def test_defaults_are_greedy_and_valid() -> None:
    params = SamplingParams()
    params.validate(vocab_size=10)
    assert params.is_greedy and params.max_new_tokens == 16 and params.stop_token_ids == ()


def test_top_p_of_exactly_one_is_allowed() -> None:
    SamplingParams(temperature=0.5, top_p=1.0).validate()


def test_to_dict_round_trips() -> None:
    params = SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9, seed=2**63, stop_token_ids=(0, 7))
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_to_dict_is_plain_json_data() -> None:
    assert SamplingParams(stop_token_ids=(3,)).to_dict()["stop_token_ids"] == [3]


def test_from_dict_fills_defaults_and_makes_numbers_floats() -> None:
    params = SamplingParams.from_dict({"temperature": 1, "stop_token_ids": [2, 3]})
    assert params == SamplingParams(temperature=1.0, stop_token_ids=(2, 3))
    assert isinstance(params.temperature, float)


def test_params_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().seed = 3  # type: ignore[misc]


def test_prompt_comes_back_as_a_tuple_of_ints() -> None:
    assert validate_prompt([0, 9, 4], vocab_size=10) == (0, 9, 4)


def test_prompt_accepts_numpy_integers() -> None:
    np = pytest.importorskip("numpy")
    assert validate_prompt(np.array([1, 2], dtype=np.int64).tolist(), 10) == (1, 2)
    assert validate_prompt([np.int64(3)], 10) == (3,)


# ---------------------------------------------------------------------------- bad sampling


def test_max_new_tokens_zero_is_rejected() -> None:
    with pytest.raises(RequestError, match=re.escape("sampling: max_new_tokens must be a positive integer, got 0")):
        SamplingParams(max_new_tokens=0)


def test_negative_max_new_tokens_is_rejected() -> None:
    with pytest.raises(RequestError, match="max_new_tokens must be a positive integer, got -4"):
        SamplingParams(max_new_tokens=-4)


def test_negative_temperature_is_rejected() -> None:
    with pytest.raises(RequestError, match=re.escape("sampling: temperature must be a finite number >= 0, got -0.1")):
        SamplingParams(temperature=-0.1)


def test_non_finite_temperature_is_rejected() -> None:
    with pytest.raises(RequestError, match="temperature must be a finite number >= 0, got nan"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(RequestError, match="temperature must be a finite number >= 0, got inf"):
        SamplingParams(temperature=math.inf)


def test_top_p_zero_is_rejected() -> None:
    with pytest.raises(RequestError, match=re.escape("sampling: top_p must be in (0, 1], got 0")):
        SamplingParams(top_p=0)


def test_top_p_above_one_is_rejected() -> None:
    with pytest.raises(RequestError, match=re.escape("sampling: top_p must be in (0, 1], got 1.5")):
        SamplingParams(top_p=1.5)


def test_stop_id_outside_vocab_is_rejected() -> None:
    params = SamplingParams(stop_token_ids=(1, 50))
    with pytest.raises(RequestError, match=re.escape("sampling: stop_token_ids[1] must be an int in [0, 50), got 50")):
        params.validate(vocab_size=50)


def test_negative_stop_id_is_rejected_without_vocab() -> None:
    with pytest.raises(RequestError, match=re.escape("stop_token_ids[0] must be a non-negative int, got -1")):
        SamplingParams(stop_token_ids=(-1,))


def test_negative_seed_is_rejected() -> None:
    with pytest.raises(RequestError, match=re.escape("sampling: seed must be an integer in [0, 2**64), got -1")):
        SamplingParams(seed=-1)


def test_bool_for_max_new_tokens_is_rejected() -> None:
    with pytest.raises(RequestError, match="max_new_tokens must be a positive integer, got True"):
        SamplingParams(max_new_tokens=True)


def test_from_dict_unknown_key_is_rejected() -> None:
    with pytest.raises(RequestError, match="sampling: unknown key 'temprature'"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_from_dict_string_number_is_rejected() -> None:
    with pytest.raises(RequestError, match="temperature must be a finite number >= 0, got '0.5'"):
        SamplingParams.from_dict({"temperature": "0.5"})


# ---------------------------------------------------------------------------- bad prompts


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(RequestError, match="^prompt: must not be empty$"):
        validate_prompt([], vocab_size=10)


def test_out_of_vocab_id_names_position_and_value() -> None:
    with pytest.raises(RequestError) as e:
        validate_prompt([1, 2, 10, 11], vocab_size=10)
    assert str(e.value) == "prompt: token id at position 2 is 10, outside [0, 10)"


def test_negative_id_is_rejected() -> None:
    with pytest.raises(RequestError, match=re.escape("position 0 is -1, outside [0, 10)")):
        validate_prompt([-1], vocab_size=10)


def test_non_int_id_names_position_and_value() -> None:
    with pytest.raises(RequestError, match="prompt: token id at position 1 must be an int, got 2.0"):
        validate_prompt([1, 2.0], vocab_size=10)
    with pytest.raises(RequestError, match="position 0 must be an int, got True"):
        validate_prompt([True], vocab_size=10)


def test_text_instead_of_ids_is_rejected() -> None:
    with pytest.raises(RequestError, match="prompt: must be a sequence of token ids, got str"):
        validate_prompt("hello", vocab_size=10)  # type: ignore[arg-type]


def test_request_error_is_a_value_error() -> None:
    assert issubclass(RequestError, ValueError)


def test_docstring_examples_run() -> None:
    result = doctest.testmod(raysched.sampling)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------- top_k, min_tokens, ignore_eos


def test_new_fields_round_trip_and_nulls_mean_absent() -> None:
    params = SamplingParams(max_new_tokens=9, temperature=0.5, top_k=7, min_tokens=4, ignore_eos=True)
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams.from_dict({"top_k": None, "min_tokens": None, "seed": None}) == SamplingParams()
    assert SamplingParams.from_dict({"top_k": -1}).top_k == -1  # vLLM's "all tokens", as 0


@pytest.mark.parametrize("data,message", [
    ({"top_k": -2}, "top_k must be an integer >= -1"),
    ({"top_k": 2.5}, "top_k must be an integer >= -1"),
    ({"min_tokens": -1}, "min_tokens must be an integer in [0, max_new_tokens (16)], got -1"),
    ({"max_new_tokens": 4, "min_tokens": 5}, "min_tokens must be an integer in [0, max_new_tokens (4)], got 5"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false, got 'yes'"),
])
def test_bad_new_fields_are_rejected(data: dict, message: str) -> None:
    with pytest.raises(RequestError, match=re.escape(f"sampling: {message}")):
        SamplingParams.from_dict(data)


def test_ignore_eos_keeps_the_eos_out_of_the_stop_ids() -> None:
    from raysched.tokenizer import load_tokenizer, with_eos_stop

    tok = load_tokenizer("tiny")
    assert with_eos_stop({"stop_token_ids": [3]}, tok)["stop_token_ids"] == [3, tok.eos_token_id]
    assert with_eos_stop({"stop_token_ids": [3], "ignore_eos": True}, tok)["stop_token_ids"] == [3]


# one non-default value per sampling key; the four ways in must all accept each
ONE_VALUE = {"max_new_tokens": 5, "temperature": 0.5, "top_p": 0.5, "top_k": 3, "seed": 11, "min_tokens": 2,
             "stop_token_ids": [4, 6], "stop": ["xy"], "ignore_eos": True}
CLI_ARGS = {"stop_token_ids": "4,6", "stop": "xy"}


def test_every_sampling_key_has_a_test_value() -> None:
    assert set(ONE_VALUE) == set(raysched.sampling.SAMPLING_KEYS)
    assert all(ONE_VALUE[k] != v for k, v in SamplingParams().to_dict().items())


@pytest.mark.parametrize("key", list(ONE_VALUE))
def test_driver_trace_cli_and_http_accept_the_same_key(key: str, tmp_path) -> None:
    from raysched.cli import build_parser
    from raysched.openai_api import HTTP_NAMES, parse_completion
    from raysched.tokenizer import load_tokenizer
    from raysched.workload import read_trace

    value = ONE_VALUE[key]
    expected = value if key != "stop_token_ids" else tuple(value)
    expected = tuple(expected) if key == "stop" else expected
    # the driver: client.submit sends the dict to the scheduler, which reads it so
    assert getattr(SamplingParams.from_dict({"max_new_tokens": 5, key: value}), key) == expected
    # a trace line
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt_ids": [1, 2], "max_new_tokens": 5, key: value}) + "\n")
    assert getattr(read_trace(trace, vocab_size=512)[0].sampling, key) == expected
    # raysched generate's flags
    flag = ["--" + key.replace("_", "-")]
    flag += [] if isinstance(value, bool) else [str(CLI_ARGS.get(key, value))]
    args = build_parser().parse_args(["generate", "--prompt-ids", "1", *flag])
    cli_value = getattr(args, key)
    assert (tuple(cli_value) if isinstance(cli_value, list) else cli_value) == expected
    # HTTP, under OpenAI's name
    body = {"prompt": [1, 2], "max_tokens": 5, HTTP_NAMES.get(key, key): value}
    parsed = parse_completion(body, load_tokenizer("tiny"), "tiny")
    got = SamplingParams.from_dict(parsed.sampling)
    assert getattr(got, key) == expected or (key == "stop_token_ids" and got.stop_token_ids[:2] == expected)
