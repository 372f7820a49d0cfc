"""Bad input: a clear message naming what is wrong, and the server keeps serving.

Submit-time cases share one launched client (one worker, a 256-token pool) on a small local Ray;
after each error a valid request must still complete with the reference tokens. Config and
workload files are checked where the user meets them (`load_serve_config`, `launch`, the CLI,
`load_workload`). The README's table of these messages is docs/bad_input.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest
import ray

import raysched
from actors.presets import PRESETS
from raysched import cli
from raysched.config import ConfigError, ServeConfig, load_serve_config
from raysched.messages import PrefillItem, StepPlan, StepResult, Usage
from raysched.request import State
from raysched.sampling import RequestError, SamplingParams
from raysched.workload import RequestSpec, load_workload
from tests.exactness import TINY_VOCAB, bare_scheduler, reference

POOL_TOKENS = 256
VALID_PROMPT = [5, 17, 42, 7, 99]


@pytest.fixture(scope="module")
def client() -> Iterator[raysched.Client]:
    if ray.is_initialized():
        ray.shutdown()
    # 3 CPUs: the shared client's worker, plus room for the workers of the launches that must fail
    ray.init(address="local", num_cpus=3, object_store_memory=80 << 20, include_dashboard=False,
             logging_level="WARNING")
    try:
        c = raysched.launch({"workers": 1, "pool": {"kv_tokens": POOL_TOKENS, "state_slots": 4}})
        try:
            yield c
        finally:
            c.shutdown()
    finally:
        ray.shutdown()


def assert_still_serving(client: raysched.Client) -> None:
    """A valid request submitted after the error completes with the reference tokens."""
    sampling = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=11)
    record = client.submit(VALID_PROMPT, sampling).result(timeout=60)
    assert record["state"] == "finished"
    want = reference([RequestSpec("ok", tuple(VALID_PROMPT), sampling)])["ok"]
    assert record["token_ids"] == want
    idle = client.check_idle()
    assert idle["workers_idle"] and not any(idle["tables"].values()), idle


def rejects(client: raysched.Client, prompt: list, sampling: dict, message: str) -> None:
    """Submitting raises RequestError with exactly `message` (no Ray traceback around it)."""
    with pytest.raises(RequestError) as info:
        client.submit(prompt, sampling)
    assert type(info.value) is RequestError and str(info.value) == message
    assert_still_serving(client)


# ---------------------------------------------------------------------------- submit time


def test_prompt_id_outside_the_vocabulary(client):
    rejects(client, [1, 2, TINY_VOCAB], {}, f"prompt: token id at position 2 is {TINY_VOCAB}, outside [0, 512)")
    rejects(client, [-1, 2], {}, "prompt: token id at position 0 is -1, outside [0, 512)")


def test_empty_prompt(client):
    rejects(client, [], {}, "prompt: must not be empty")


def test_prompt_plus_max_new_tokens_beyond_the_model_context(client):
    rejects(client, [1, 2, 3], {"max_new_tokens": 8190},
            "prompt (3) + max_new_tokens (8190) = 8193 exceeds the model context of 8192 tokens")


def test_prompt_plus_max_new_tokens_beyond_the_largest_worker_pool(client):
    rejects(client, list(range(10)), {"max_new_tokens": 300},
            f"prompt (10) + max_new_tokens (300) = 310 tokens, more than the largest worker pool "
            f"({POOL_TOKENS} KV tokens); at most {POOL_TOKENS - 10} new tokens fit after this prompt")


@pytest.mark.parametrize("value", [0, -3])
def test_max_new_tokens_not_positive(client, value):
    rejects(client, VALID_PROMPT, {"max_new_tokens": value},
            f"sampling: max_new_tokens must be a positive integer, got {value}")


def test_negative_temperature(client):
    rejects(client, VALID_PROMPT, {"temperature": -0.5}, "sampling: temperature must be a finite number >= 0, got -0.5")


@pytest.mark.parametrize("value", [0, 1.5])
def test_top_p_outside_zero_one(client, value):
    rejects(client, VALID_PROMPT, {"top_p": value}, f"sampling: top_p must be in (0, 1], got {float(value)}")


def test_mistyped_sampling_key(client):
    rejects(client, VALID_PROMPT, {"max_tokens": 4},
            "sampling: unknown key 'max_tokens' (known: max_new_tokens, temperature, top_p, top_k, seed, "
            "min_tokens, stop_token_ids, stop, ignore_eos)")


def test_negative_top_k(client):
    rejects(client, VALID_PROMPT, {"top_k": -2},
            "sampling: top_k must be an integer >= -1 (0 or -1: all tokens), got -2")


def test_min_tokens_above_max_new_tokens(client):
    rejects(client, VALID_PROMPT, {"max_new_tokens": 4, "min_tokens": 5},
            "sampling: min_tokens must be an integer in [0, max_new_tokens (4)], got 5")


def test_ignore_eos_not_a_boolean(client):
    rejects(client, VALID_PROMPT, {"ignore_eos": "yes"}, "sampling: ignore_eos must be true or false, got 'yes'")


def test_stop_token_outside_the_vocabulary(client):
    rejects(client, VALID_PROMPT, {"stop_token_ids": [7, 9999]},
            "sampling: stop_token_ids[1] must be an int in [0, 512), got 9999")


def test_request_id_already_in_use(client):
    first = client.submit(VALID_PROMPT, {"max_new_tokens": 2}, request_id="dup")
    try:
        with pytest.raises(RequestError) as info:
            client.submit(VALID_PROMPT, {}, request_id="dup")
        assert str(info.value) == "request id 'dup' is already in use"
    finally:
        assert first.result(timeout=60)["state"] == "finished"
    assert_still_serving(client)


# ---------------------------------------------------------------------------- serve config


def test_unknown_serve_config_key(client):
    with pytest.raises(ConfigError) as info:
        raysched.launch({"workers": 1, "shceduler": {"retract": "snapshot"}})
    assert str(info.value) == "serve config: unknown key 'shceduler' (did you mean 'scheduler'?)"
    with pytest.raises(ConfigError) as info:
        load_serve_config({"scheduler": {"max_retraction": 3}})
    assert str(info.value) == ("serve config: unknown key 'scheduler.max_retraction' "
                               "(did you mean 'max_retractions'?)")
    assert_still_serving(client)


def test_malformed_serve_yaml_names_file_and_line(client, tmp_path, capsys):
    bad = tmp_path / "serve.yaml"
    bad.write_text("workers: 2\npool:\n  kv_tokens: [160\n  state_slots: 4\n")
    with pytest.raises(ConfigError) as info:
        load_serve_config(bad)
    text = str(info.value)
    assert text.startswith(f"serve config: {bad}:") and "malformed YAML" in text, text
    workload = tmp_path / "workload.yaml"
    workload.write_text("requests: 2\n")
    assert cli.main(["run", "--config", str(bad), "--workload", str(workload)]) == 2
    assert f"raysched run: error: serve config: {bad}:" in capsys.readouterr().err
    assert_still_serving(client)


# ---------------------------------------------------------------------------- workload


def test_unknown_workload_key(client):
    with pytest.raises(ConfigError) as info:
        load_workload({"requests": 3, "promt_len": [2, 4]}, TINY_VOCAB)
    assert str(info.value) == "workload: unknown key 'promt_len' (did you mean 'prompt_len'?)"
    assert_still_serving(client)


def test_malformed_trace_line_names_the_line(client, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_ids": [1, 2], "max_new_tokens": 4}\n'
                     '{"prompt_ids": [3, 4], "max_new_tokens": 4\n')
    (tmp_path / "w.yaml").write_text("trace: trace.jsonl\n")
    with pytest.raises(ConfigError) as info:
        load_workload(tmp_path / "w.yaml", TINY_VOCAB)
    text = str(info.value)
    assert text.startswith(f"workload: {trace}:2: malformed JSON:"), text
    assert_still_serving(client)


# ---------------------------------------------------------------------------- checkpoints


def test_missing_checkpoint_directory(client, tmp_path, capsys):
    missing = tmp_path / "no-such-checkpoint"
    serve = tmp_path / "serve.yaml"
    serve.write_text(f"model: {missing}\nworkers: 1\n")
    workload = tmp_path / "workload.yaml"
    workload.write_text("requests: 2\n")
    assert cli.main(["run", "--config", str(serve), "--workload", str(workload), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (f"raysched run: error: serve config: model '{missing}' is neither a preset "
                   f"({', '.join(PRESETS)}) nor a directory\n")  # checked before any worker starts
    assert_still_serving(client)


def test_checkpoint_directory_without_config_json(client, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as info:
        raysched.launch({"model": str(empty), "workers": 1})
    assert str(info.value) == (f"serve config: model '{empty}' is a directory without config.json (a checkpoint "
                               f"as transformers' save_pretrained writes it)")
    assert_still_serving(client)


def test_the_control_planes_preset_names_are_the_presets():
    from raysched.config import PRESET_NAMES

    assert PRESET_NAMES == tuple(PRESETS)


def test_checkpoint_of_another_architecture(client, tmp_path):
    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ConfigError) as info:
        raysched.launch({"model": str(ckpt), "workers": 1})
    assert str(info.value) == (
        f"serve config: model '{ckpt}': worker 0 could not start: CheckpointError: {ckpt}/config.json: "
        "unsupported architecture ['LlamaForCausalLM']; supported: ['BambaForCausalLM', "
        "'GraniteMoeHybridForCausalLM', 'NemotronHForCausalLM', 'Qwen3_5ForCausalLM', 'Qwen3NextForCausalLM']")
    assert_still_serving(client)


# ---------------------------------------------------------------------------- snapshots


def test_snapshot_from_another_model_is_refused_by_the_worker():
    from actors.worker import Worker

    home, foreign = Worker(ServeConfig(seed=0, device="cpu"), 0), Worker(ServeConfig(seed=1, device="cpu"), 1)
    item = PrefillItem("r", tuple(VALID_PROMPT), len(VALID_PROMPT), SamplingParams(max_new_tokens=8).to_dict())
    foreign.step(StepPlan(prefill=(item,), decode_steps=2))
    snap = foreign.retract("r")
    result = home.step(StepPlan(resume=("r",), decode_steps=1), snap)
    assert set(result.resume_failed) == {"r"}
    assert "snapshot of 'r' was taken on model" in result.resume_failed["r"], result.resume_failed
    assert not result.new_tokens and home.is_idle()  # refused before anything was allocated
    # the same worker keeps serving: a recompute of that request from its tokens runs there
    history = PrefillItem("r", snap.token_ids, snap.prompt_len, snap.sampling)
    result = home.step(StepPlan(prefill=(history,), decode_steps=8))
    assert result.finished == {"r": "length"} and home.is_idle()


def test_refused_snapshot_is_recomputed_and_logged_by_the_scheduler(caplog):
    """The scheduler side of a refusal (the cluster run is in test_faults: corrupt_snapshot)."""
    async def scenario() -> None:
        sched, w = bare_scheduler()
        rid = await sched.submit(VALID_PROMPT, {"max_new_tokens": 8})
        req = sched.requests[rid]
        plan = sched.dispatch.decide(w)
        sched.dispatch.mark_running(w, plan.admit)
        req.output_ids, req.retractions, req.snapshot_ref = [3, 4], 1, object()  # resuming
        why = "snapshot of 'req-0' was taken on model other, this worker runs model mine"
        with caplog.at_level(logging.WARNING, logger="raysched.scheduler"):
            sched.dispatch.apply(w, plan, StepResult(resume_failed={rid: why}, usage=Usage(256, 256, 4, 4, 1)), [req])
        assert req.state is State.RETRACTED and req.recompute and req.snapshot_ref is None
        assert list(sched.retracted) == [req]
        assert sched.counters.snapshots_refused == 1
        assert f"snapshot of {rid} refused on worker 0 ({why}); recomputing it instead" in caplog.text

    asyncio.run(scenario())
