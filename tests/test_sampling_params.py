"""SamplingParams and prompts: invalid requests are refused with the field and value named."""

from __future__ import annotations

import dataclasses
import doctest
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
