"""The OpenAI-compatible server on a real local Ray Serve instance, on the loopback.

One server for the module (Serve takes ~15 s to start): app `raysched` at / requires an API key,
app `open` at /open (same scheduler) does not. Token ids are compared with independent in-process
references (`raysched generate`, `Engine.generate`); a different seed must change them (negative
control). A client that disconnects must leave every pool and table empty and be counted as an
abort; every bad input gets a 4xx with OpenAI's error JSON and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import re
import os
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import ray

import raysched
from raysched import cli
from raysched.config import load_serve_config
from raysched.sampling import SamplingParams
from raysched.serve import Server, deploy_app, start_server
from raysched.tokenizer import load_tokenizer
from tests.conftest import reference_tokens, stream_token_ids, wait_until

KEY = "sk-raysched-test"
NAME = "test-serve"
CONFIG = {"model": "tiny", "workers": 2, "pool": {"kv_tokens": 4096, "state_slots": 16}}


@dataclass
class Running:
    server: Server
    client: raysched.Client  # connected to the same named scheduler

    @property
    def open_url(self) -> str:
        return f"{self.server.url}/open"

    def openai(self, keyed: bool = False, key: str = KEY) -> openai.OpenAI:
        base = self.server.url if keyed else self.open_url
        return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.open_url, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def running() -> Iterator[Running]:
    server = start_server(load_serve_config(CONFIG), port=_free_port(), api_key=KEY, name=NAME, num_cpus=3)
    try:
        deploy_app(NAME, api_key=None, app_name="open", route_prefix="/open")
        yield Running(server, raysched.connect(name=NAME))
    finally:
        server.stop()
    assert not ray.is_initialized()


def _generate(capsys: pytest.CaptureFixture, *args: str) -> dict:
    capsys.readouterr()
    assert cli.main(["generate", "--model", "tiny", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["outputs"][0]


def _sse_events(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _wait_idle(client: raysched.Client) -> None:
    last: list[dict] = []

    def idle() -> bool:
        last[:] = [client.check_idle()]
        return last[0]["workers_idle"] and not any(last[0]["tables"].values())

    try:
        wait_until(idle, 60, "every pool and scheduler table to be empty")
    except BaseException:
        print("last check_idle:", last)
        raise


# ---------------------------------------------------------------------------- happy paths


def test_health_models_and_auth(running: Running) -> None:
    with httpx.Client(base_url=running.server.url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}  # health needs no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
    assert [m.id for m in running.openai(keyed=True).models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        running.openai(keyed=True, key="wrong").completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert [m.id for m in running.openai().models.list().data] == ["tiny"]  # the open app: no key


def test_text_completion_equals_raysched_generate(running: Running, capsys: pytest.CaptureFixture) -> None:
    api = running.openai(keyed=True)
    for temperature, seed in ((0.0, 0), (0.9, 5)):
        out = api.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=temperature,
                                     seed=seed, extra_body={"return_token_ids": True})
        ref = _generate(capsys, "--prompt", "Hello world", "--max-new-tokens", "20",
                        "--temperature", str(temperature), "--seed", str(seed))
        choice = out.choices[0]
        assert choice.token_ids == ref["token_ids"] and choice.text == ref["text"]
        assert choice.prompt_token_ids == ref["prompt_ids"] == load_tokenizer("tiny").encode("Hello world")
        assert out.usage.prompt_tokens == len(ref["prompt_ids"])
        assert out.usage.completion_tokens == len(ref["token_ids"])
        assert out.usage.prompt_tokens_details.cached_tokens == 0
    other = api.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=0.9, seed=6,
                                   extra_body={"return_token_ids": True})
    assert other.choices[0].token_ids != ref["token_ids"]  # negative control: the seed matters


def test_token_id_prompt_streamed_and_not(running: Running, capsys: pytest.CaptureFixture) -> None:
    body = {"model": "tiny", "prompt": [5, 17, 42], "max_tokens": 18, "temperature": 0.7, "seed": 3,
            "ignore_eos": True, "return_token_ids": True}
    ref = _generate(capsys, "--prompt-ids", "5,17,42", "--max-new-tokens", "18", "--temperature", "0.7",
                    "--seed", "3")
    with running.http() as http:
        whole = http.post("/v1/completions", json=body).json()
        with http.stream("POST", "/v1/completions",
                         json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _sse_events(r)
    assert whole["choices"][0]["token_ids"] == ref["token_ids"]
    assert whole["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 18
    chunks = [e for e in events[:-2]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ref["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"] == ref["text"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 17, 42]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_streams_with_role_first_and_matches_the_template(running: Running,
                                                                capsys: pytest.CaptureFixture) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    api = running.openai()
    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                        extra_body={"return_token_ids": True})
    stream = api.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                         stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    rendered = load_tokenizer("tiny").chat_prompt(messages)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and rendered.endswith("assistant\n")
    ref = _generate(capsys, "--prompt", rendered, "--max-new-tokens", "16")
    assert whole.choices[0].token_ids == ref["token_ids"]  # type: ignore[attr-defined]
    assert whole.choices[0].message.content == ref["text"]


def test_second_chat_turn_restores_the_first_turns_state(running: Running) -> None:
    """The turn cache through the OpenAI endpoint: turn 2 resends turn 1's history, re-rendered by
    the chat template; its usage reports the prompt tokens restored instead of prefilled (at
    least turn 1's prompt point: its last 32-token grid point before its end). The same
    first turn with another system prompt (nothing parked for it) reports none: the control."""
    api = running.openai()
    system = "You answer in one short line, and never more than that. " * 6  # > min_tokens (64)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    first = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    prompt_1 = load_tokenizer("tiny").chat_prompt(messages)
    assert first.usage.prompt_tokens >= 64, first.usage
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And another one?"}]
    assert load_tokenizer("tiny").chat_prompt(messages).startswith(prompt_1)
    second = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    grid = (first.usage.prompt_tokens - 1) // 32 * 32  # its prompt point, if the answer re-encodes otherwise
    assert grid <= cached < second.usage.prompt_tokens, second.usage
    other = [{"role": "system", "content": system.upper()}, messages[1]]
    fresh = api.chat.completions.create(model="tiny", messages=other, max_tokens=8, temperature=0)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0, fresh.usage


def test_chats_sharing_a_long_system_prompt_report_its_whole_chunks_as_cached(running: Running) -> None:
    """Prefix reuse through the OpenAI endpoint: two chats that share only a system prompt longer
    than a prefill chunk (512 tokens); the second restores the first's point at the last chunk
    boundary inside it and reports those tokens as cached."""
    api = running.openai()
    system = "Keep every answer short, plain and polite; use no lists. " * 60
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    tok = load_tokenizer("tiny")
    shared = len(os.path.commonprefix([tok.encode(tok.chat_prompt(m)) for m in (first, second)]))
    a = api.chat.completions.create(model="tiny", messages=first, max_tokens=4, temperature=0)
    b = api.chat.completions.create(model="tiny", messages=second, max_tokens=4, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0, a.usage
    assert shared >= 512 and b.usage.prompt_tokens_details.cached_tokens == shared // 512 * 512, (shared, b.usage)


def test_chats_sharing_a_system_message_one_after_the_other_reuse_it_from_the_second_on(running: Running) -> None:
    """Three chats with one system message (~140 tokens) and different questions, each sent
    after the previous answer: the chat endpoint declares the system message shared
    (`shared_prefix`), so the first chat parks a point at its last grid point and the second
    and third restore it, answering with the uncached run's tokens. Control: the same kind of
    prompts sent as plain completions (nothing declared) give the second one nothing: nobody
    knew where it would leave the first."""
    api, tok = running.openai(), load_tokenizer("tiny")
    system = "You are terse. You answer in one short line, never more than that. " * 4
    asks = tuple(f"{what}? Tell me one thing about them, and keep it short and plain, please. " * 2
                 for what in ("Colours", "Fruit", "Trees"))  # > 32 tokens each: prompt points lie past the system
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in asks]
    alone = len(tok.encode(tok.chat_prompt(chats[0][:1], add_generation_prompt=False)))
    got = [api.chat.completions.create(model="tiny", messages=m, max_tokens=5, temperature=0,
                                       extra_body={"return_token_ids": True}) for m in chats]
    assert [g.usage.prompt_tokens_details.cached_tokens for g in got] == [0, alone // 32 * 32, alone // 32 * 32]
    ids = [tok.encode(tok.chat_prompt(m)) for m in chats]
    want = reference_tokens("tiny", ids, [SamplingParams(max_new_tokens=5)] * 3)
    assert [g.choices[0].token_ids for g in got] == want  # type: ignore[attr-defined]
    plain = [tok.chat_prompt([{"role": "system", "content": system.upper()}, {"role": "user", "content": q}])
             for q in asks[:2]]
    done = [api.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0) for p in plain]
    assert [d.usage.prompt_tokens_details.cached_tokens for d in done] == [0, 0]


def test_the_same_prompt_sent_again_reports_all_but_its_last_grid_block_cached(running: Running) -> None:
    """The same 300-token prompt twice, one after the other (nothing shares it while it runs):
    the first parks its prompt point at its last 32-token grid point (288), so the second
    restores 288 tokens and answers with the same tokens. Control: the prompt with another
    first token shares nothing parked and reports none. `/metrics` counts what the answers
    report: one hit, two misses, 288 cached tokens."""
    api, before = running.openai(), _prefix_metrics(running)
    rng = random.Random(7)
    ids = [rng.randrange(1, 500) for _ in range(300)]
    ask = lambda p: api.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0,  # noqa: E731
                                           extra_body={"return_token_ids": True})
    first, second = ask(ids), ask(ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0, first.usage
    assert second.usage.prompt_tokens_details.cached_tokens == 288, second.usage
    assert second.choices[0].token_ids == first.choices[0].token_ids  # type: ignore[attr-defined]
    other = ask([ids[0] + 1] + ids[1:])
    assert other.usage.prompt_tokens_details.cached_tokens == 0, other.usage
    after = _prefix_metrics(running)
    assert {k: after[k] - before[k] for k in after} == {"hits": 1, "misses": 2, "cached_tokens": 288}, (before, after)


def _prefix_metrics(running: Running) -> dict[str, float]:
    """The prefix-reuse counters of `/metrics`: hits (all kinds), misses, cached tokens."""
    lines = httpx.get(f"{running.open_url}/metrics", timeout=60).text.splitlines()
    value = lambda prefix: sum(float(ln.split()[-1]) for ln in lines if ln.startswith(prefix))  # noqa: E731
    return {"hits": value("raysched_prefix_cache_hits_total{"), "misses": value("raysched_prefix_cache_misses_total "),
            "cached_tokens": value("raysched_prefix_cached_tokens_total ")}


def test_stop_string_cuts_text_and_ends_early(running: Running) -> None:
    api = running.openai()
    full = api.completions.create(model="tiny", prompt="The", max_tokens=40, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    text = full.text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    cut = text.index(stop)
    out = api.completions.create(model="tiny", prompt="The", max_tokens=40, temperature=0, stop=[stop],
                                 extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert out.text == text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    streamed = api.completions.create(model="tiny", prompt="The", max_tokens=40, temperature=0, stop=[stop],
                                      stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]
    # the driver API stops at the same place, through the same scheduler
    handle = running.client.submit(full.prompt_token_ids, {"max_new_tokens": 40, "stop": [stop]})
    pieces = list(handle.stream_text())
    assert "".join(t for t, _ in pieces) == text[:cut]
    assert [i for _, ids in pieces for i in ids] == out.token_ids


NEUTRAL = {"logit_bias": {}, "repetition_penalty": 1, "min_p": 0, "top_k": -1, "min_tokens": 0, "n": 1,
           "presence_penalty": 0.0, "frequency_penalty": 0, "metadata": {"run": "x"}, "store": False,
           "service_tier": "auto", "user": "u", "response_format": {"type": "text"}}
NULLS = {k: None for k in ("n", "presence_penalty", "frequency_penalty", "echo", "best_of", "stream", "logprobs",
                           "stop", "top_p", "top_k", "min_tokens", "stream_options", "user", "metadata",
                           "stop_token_ids", "repetition_penalty", "min_p", "logit_bias", "response_format")}


def test_neutral_informational_and_null_parameters_change_nothing(running: Running) -> None:
    """What benchmark clients and typed SDKs send (guidellm, aiperf, openai-python): neutral values,
    informational keys and explicit nulls are accepted and change no token; a null
    max_completion_tokens leaves max_tokens in force. Control: a real max_completion_tokens wins."""
    base = {"prompt": [5, 17, 42], "max_tokens": 6, "temperature": 0.9, "seed": 2, "ignore_eos": True,
            "return_token_ids": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True,
            "return_token_ids": True}
    with running.http() as http:
        plain = http.post("/v1/completions", json=base).json()["choices"][0]["token_ids"]
        for extra in (NEUTRAL, NULLS):  # nulls for the keys `base` leaves out
            r = http.post("/v1/completions", json={**extra, **base})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == plain
        tools = {"tools": [], "tool_choice": "none", "chat_template_kwargs": {"enable_thinking": False}}
        r = http.post("/v1/chat/completions", json={**chat, **tools, "max_completion_tokens": None})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        r = http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 6})
        assert r.json()["usage"]["completion_tokens"] == 6


def test_top_k_and_min_tokens_over_http_equal_generate_and_the_driver(running: Running,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """The same sampling keys through HTTP, `raysched generate` and `client.submit` give the same
    tokens. min_tokens holds back stop tokens the request would otherwise end on (control: without
    it, the request stops early on one of them)."""
    body = {"prompt": [5, 17, 42], "max_tokens": 16, "temperature": 0.9, "seed": 3, "top_k": 5,
            "ignore_eos": True, "return_token_ids": True}
    with running.http() as http:
        free = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        stops = sorted(set(free[1:6]))
        early = http.post("/v1/completions", json={**body, "stop_token_ids": stops}).json()["choices"][0]
        held = http.post("/v1/completions", json={**body, "stop_token_ids": stops, "min_tokens": 10}).json()
    held_ids = held["choices"][0]["token_ids"]
    assert early["finish_reason"] == "stop" and len(early["token_ids"]) <= 6  # control
    assert len(held_ids) >= 10 and not set(held_ids[:10]) & set(stops)
    ref = _generate(capsys, "--prompt-ids", "5,17,42", "--max-new-tokens", "16", "--temperature", "0.9",
                    "--seed", "3", "--top-k", "5", "--min-tokens", "10",
                    "--stop-token-ids", ",".join(map(str, stops)))
    assert held_ids == ref["token_ids"]
    sampling = {"max_new_tokens": 16, "temperature": 0.9, "seed": 3, "top_k": 5, "min_tokens": 10,
                "stop_token_ids": stops, "ignore_eos": True}
    assert running.client.submit([5, 17, 42], sampling).result()["token_ids"] == held_ids


def test_a_stop_string_before_min_tokens_does_not_end_the_request(running: Running) -> None:
    """The scheduler matches stop strings as tokens arrive and ends the request there; one that
    completes before `min_tokens` tokens must not end it (the scheduler's matcher once did not
    get min_tokens). Control: without min_tokens the same stop string ends it early."""
    sampling = {"max_new_tokens": 16, "temperature": 0.9, "seed": 3, "top_k": 5, "ignore_eos": True}
    tok = running.client.tokenizer
    free = running.client.submit([5, 17, 42], sampling).result()["token_ids"]
    stop = next(t for t in (tok.decode(free[:k]) for k in range(1, 6)) if t.strip() and t[-1] != "\ufffd")[-1]
    early = running.client.submit([5, 17, 42], {**sampling, "stop": [stop]}).result()
    held = running.client.submit([5, 17, 42], {**sampling, "stop": [stop], "min_tokens": 12}).result()
    assert early["finish_reason"] == "stop" and len(early["token_ids"]) <= 5  # control
    assert len(held["token_ids"]) >= 12 and held["token_ids"][:12] == free[:12]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(running: Running) -> None:
    body = {"prompt": [5, 17, 42], "max_tokens": 8, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with running.http() as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream_options": {
                "include_usage": True, "continuous_usage_stats": True}}) as r:
            events = _sse_events(r)
        with http.stream("POST", "/v1/completions", json=body) as r:
            plain = _sse_events(r)
    chunks, final = events[:-2], events[-2]
    so_far = 0
    for c in chunks:
        so_far += len(c["choices"][0]["token_ids"])
        assert c["usage"] == {"prompt_tokens": 3, "completion_tokens": so_far, "total_tokens": 3 + so_far}
    assert so_far == 8 and final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    assert plain[-1] == "[DONE]" and not any("usage" in c for c in plain[:-1])  # control: not asked for


def test_head_answers_like_get_without_a_body_and_405_says_allow(running: Running) -> None:
    with httpx.Client(base_url=running.server.url, timeout=60) as http:
        for path in ("/health", "/metrics", "/open/v1/models"):
            r = http.head(path)
            assert r.status_code == 200 and r.content == b"", path
        r = http.head("/v1/models")  # the keyed app
        assert r.status_code == 401 and r.content == b""
        for method, path, allow in (("DELETE", "/open/v1/models", "GET, HEAD"),
                                    ("GET", "/open/v1/completions", "POST")):
            r = http.request(method, path)
            assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == set(allow.split(", "))
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.json()["error"]["message"] == f"no route {method} {path}"


def test_32_concurrent_streams(running: Running) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(4, 20))] for _ in range(32)]
    params = [SamplingParams(max_new_tokens=rng.randint(8, 24), temperature=0.8 * (i % 2), seed=i)
              for i in range(32)]
    expected = reference_tokens("tiny", prompts, params)

    async def all_of_them() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=f"{running.open_url}/v1", api_key="x", max_retries=0,
                                      timeout=300) as api:
            return await asyncio.gather(*[stream_token_ids(api, "tiny", p, sp) for p, sp in zip(prompts, params)])

    assert asyncio.run(all_of_them()) == expected
    _wait_idle(running.client)


def _disconnects(running: Running) -> float:
    """raysched_client_disconnects_total of the `open` app (each app's server counts its own)."""
    text = httpx.get(f"{running.open_url}/metrics", timeout=60).text
    return float(next(ln for ln in text.splitlines() if ln.startswith("raysched_client_disconnects_total")).split()[-1])


UNRETRIEVED_WINDOW_S = 5.0  # how long after the aborts the log must stay free of the message
REPORT_CHARS = 20_000  # of a report (to the next one): its traceback, chained ones included


def _unretrieved_in_logs() -> int:
    """'... exception was never retrieved' reports in this Ray session's logs (the replica's
    stderr) whose traceback passes through raysched's code. (Those of Serve's HTTP entrypoint
    task, `_call_http_entrypoint`, were once all left out as Ray's own: they were ours, a
    cancelled scheduler call or sink poll ending a handler with TaskCancelledError.)"""
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    marker = "exception was never retrieved"
    return sum(1 for p in logs.rglob("*") if p.is_file() and p.suffix in (".err", ".out", ".log")
               for report in p.read_text(errors="replace").split(marker)[1:] if "raysched/" in report[:REPORT_CHARS])


def test_client_disconnect_aborts_and_frees_slots(running: Running) -> None:
    """...and counts one disconnect per aborted request, without a traceback in the server's log."""
    aborted, disconnects, unretrieved = running.client.stats()["aborted"], _disconnects(running), _unretrieved_in_logs()
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with running.http() as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: ")
        # the connection is closed with ~4000 tokens to go
    wait_until(lambda: running.client.stats()["aborted"] == aborted + 1, 60, "the streamed request's abort")
    _wait_idle(running.client)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=running.open_url, timeout=1.0) as http:
        http.post("/v1/completions", json={**body, "stream": False})  # the client gives up waiting
    wait_until(lambda: running.client.stats()["aborted"] == aborted + 2, 60, "the waiting request's abort")
    _wait_idle(running.client)
    wait_until(lambda: _disconnects(running) == disconnects + 2, 60, "two disconnects counted")
    quiet_until = time.monotonic() + UNRETRIEVED_WINDOW_S  # the message comes when the task is
    while time.monotonic() < quiet_until:  # collected and reaches the log file a little later
        assert _unretrieved_in_logs() == unretrieved
        time.sleep(0.25)


def test_the_first_stream_of_a_replica_leaving_does_not_end_the_others(running: Running) -> None:
    """A replica reads every stream from its sink in one poll task, started by the first stream
    it serves. Ray cancels the calls a request made when its client leaves: made in that first
    handler's context, the poll was such a call, and its cancellation failed every stream of the
    replica from then on (found with a guidellm-like burst: 48 streams, their clients leaving
    together). A fresh app (a replica whose reader is not started): its first stream is read for
    one chunk and dropped (its request is aborted: the leave was seen), then another streams to
    its end with the uncached in-process tokens, and the log has no 'never retrieved' report."""
    from ray import serve

    aborted, unretrieved = running.client.stats()["aborted"], _unretrieved_in_logs()
    deploy_app(NAME, api_key=None, app_name="fresh", route_prefix="/fresh")
    try:
        leaving = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=f"{running.server.url}/fresh", timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=leaving) as r:
                assert next(r.iter_lines()).startswith("data: ")
        wait_until(lambda: running.client.stats()["aborted"] == aborted + 1, 60, "the dropped stream's abort")
        with openai.OpenAI(base_url=f"{running.server.url}/fresh/v1", api_key="x", max_retries=0, timeout=120) as api:
            stream = api.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=24, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
            got = [t for c in stream for t in c.choices[0].token_ids]  # type: ignore[attr-defined]
        assert got == reference_tokens("tiny", [[5, 6, 7]], [SamplingParams(max_new_tokens=24)])[0]
        time.sleep(UNRETRIEVED_WINDOW_S)  # a report reaches the log when its task is collected
        assert _unretrieved_in_logs() == unretrieved
    finally:
        serve.delete("fresh")
    _wait_idle(running.client)


def test_abort_with_forget_leaves_no_record_behind(running: Running) -> None:
    """What the HTTP handler sends when its client goes away: the request ends and leaves the
    live tables at once, though nobody reads it; a plain abort (the control) keeps it there
    until it is read. Both records stay readable."""
    from raysched.deployment import find_scheduler

    sched = find_scheduler(NAME)
    sampling = SamplingParams(max_new_tokens=4000).to_dict()
    before = running.client.check_idle()["tables"]["requests"]
    for rid, forget in (("plain-abort", False), ("forget-abort", True)):
        ray.get(sched.submit.remote([1, 2, 3], sampling, rid))
        assert ray.get(sched.abort.remote(rid, forget)) is True
    assert running.client.check_idle()["tables"]["requests"] == before + 1  # the plain one only
    assert ray.get(sched.wait.remote("plain-abort"))["finish_reason"] == "abort"
    assert ray.get(sched.wait.remote("forget-abort"))["finish_reason"] == "abort"
    _wait_idle(running.client)


@pytest.mark.parametrize("spec", ["2.0", "2.4"])
@pytest.mark.parametrize("closing", [True, False], ids=["closing", "plain-starlette"])
def test_disconnect_in_send_runs_the_stream_cleanup(spec: str, closing: bool) -> None:
    """The disconnect lands while the response awaits `send` (the body generator sits at a
    `yield`): ClosingStreamingResponse runs the generator's `finally` (the abort) before it returns;
    Starlette's own StreamingResponse leaves it to the garbage collector (negative control)."""
    from fastapi.responses import StreamingResponse

    from raysched.serve import ClosingStreamingResponse

    cleaned: list[bool] = []

    async def body():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            cleaned.append(True)

    async def run() -> None:
        in_send = asyncio.Event()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                in_send.set()
                await asyncio.sleep(3600)  # a slow client: the body chunk is still being written

        async def receive() -> dict:
            await asyncio.sleep(3600)  # no disconnect message: only the cancellation says so
            return {"type": "http.disconnect"}

        gen = body()
        response = (ClosingStreamingResponse if closing else StreamingResponse)(gen, media_type="text/event-stream")
        task = asyncio.create_task(response({"type": "http", "asgi": {"spec_version": spec}}, receive, send))
        await in_send.wait()
        task.cancel()  # what Serve does to the handler when the proxy sees the client go
        with pytest.raises(asyncio.CancelledError):
            await task
        if not closing and cleaned:
            pytest.skip("this Starlette closes the body iterator itself")
        assert cleaned == ([True] if closing else [])  # `gen` is still referenced here
        await gen.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("closing", [True, False], ids=["closing", "plain-starlette"])
def test_serve_receive_raising_task_cancelled_is_a_disconnect(closing: bool) -> None:
    """Serve's `receive` raises TaskCancelledError once the client has gone (under ASGI spec 2.0,
    Starlette listens for the disconnect). ClosingStreamingResponse reads that as the disconnect
    and returns; Starlette's own response lets it escape (negative control), and the handler's
    task then ends in the logged 'Task exception was never retrieved'."""
    from fastapi.responses import StreamingResponse

    from raysched.serve import ClosingStreamingResponse

    async def body():
        for i in range(3):
            yield f"data: {i}\n\n"
        await asyncio.sleep(3600)  # a long stream: only the disconnect ends it

    async def receive() -> dict:
        await asyncio.sleep(0.05)
        raise ray.exceptions.TaskCancelledError()

    async def send(message: dict) -> None:
        pass

    async def run() -> BaseException | None:
        response = (ClosingStreamingResponse if closing else StreamingResponse)(body(), media_type="text/event-stream")
        try:
            await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.0"}}, receive, send), 5)
        except Exception as err:
            return err
        return None

    err = asyncio.run(run())
    if closing:
        assert err is None
    else:
        assert isinstance(err, ray.exceptions.TaskCancelledError) or (
            isinstance(err, BaseExceptionGroup) and err.subgroup(ray.exceptions.TaskCancelledError))


@pytest.mark.parametrize("quiet", [True, False], ids=["quiet", "plain-wrap_future"])
def test_a_call_abandoned_by_a_cancelled_handler_logs_nothing(quiet: bool) -> None:
    """The handler awaiting a scheduler call is cancelled, then Ray completes the call as cancelled:
    `_quiet_future` marks that outcome seen; a plain wrapped future (negative control) makes asyncio
    report 'Future exception was never retrieved'."""
    import concurrent.futures
    import gc

    from raysched.serve import _quiet_future

    class Ref:  # what _quiet_future uses of an ObjectRef
        def __init__(self) -> None:
            self.fut: concurrent.futures.Future = concurrent.futures.Future()

        def future(self) -> concurrent.futures.Future:
            return self.fut

    reported: list[str] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx["message"]))
        ref = Ref()
        future = _quiet_future(ref) if quiet else asyncio.wrap_future(ref.future())
        waiter = asyncio.ensure_future(asyncio.shield(future))
        await asyncio.sleep(0)
        waiter.cancel()  # the handler goes; the call itself is not cancelled by that
        ref.fut.set_exception(ray.exceptions.TaskCancelledError())  # Ray: the call was cancelled
        await asyncio.sleep(0.05)
        del future, waiter
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(run())
    assert reported == ([] if quiet else ["Future exception was never retrieved"])


@pytest.mark.parametrize("error", [ray.exceptions.TaskCancelledError, ray.exceptions.RayActorError])
def test_a_handler_call_that_ray_cancelled_cancels_the_handler(error: type) -> None:
    """Every call a handler awaits (a quiet stream's status call too) goes through `_await_call`:
    Ray's TaskCancelledError (the handler's client left) becomes the handler's cancellation, not
    an error that ends its task in a logged traceback. Control: a dead scheduler's RayActorError
    stays what it is (the handler answers it with a 503)."""
    import concurrent.futures

    from raysched.serve import _await_call

    class Ref:  # what _await_call uses of an ObjectRef
        def __init__(self) -> None:
            self.fut: concurrent.futures.Future = concurrent.futures.Future()
            self.fut.set_exception(error())

        def future(self) -> concurrent.futures.Future:
            return self.fut

    async def run() -> BaseException:
        try:
            await _await_call(Ref(), 5)
        except BaseException as err:  # noqa: BLE001 - what it raised is the point
            return err
        raise AssertionError("no error")

    raised = asyncio.run(run())
    assert type(raised) is (asyncio.CancelledError if error is ray.exceptions.TaskCancelledError else error), raised


def test_bench_serve_measures_both_sides_with_equal_tokens(running: Running) -> None:
    """`raysched bench serve`'s measuring functions, on this module's server (its own smoke run,
    which starts another Serve, is behind the serve_slow marker)."""
    from benchmarks.serve import QUICK, _result, run_driver, run_http
    from raysched.workload import build_requests

    specs = build_requests(QUICK.workload, running.client.vocab_size())[:8]
    http = asyncio.run(run_http(running.open_url, "tiny", specs))
    driver = run_driver(running.client, specs, 0)
    result = _result(QUICK, specs, [http], [driver])
    assert result["mismatched_requests"] == [] and result["rows"][0]["tokens"] == result["rows"][1]["tokens"]
    assert len(http["ttft_s"]) == len(specs) and all(t > 0 for t in http["ttft_s"])
    assert result["itl"]["p50_ms"] is not None and result["ratio"] > 0
    _wait_idle(running.client)


# ---------------------------------------------------------------------------- bad input

BAD = [  # (path, body, status, fragment of the message)
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt: must be a string or a list of token ids"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt: must not be empty"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "outside [0, 512)"),
    ("/v1/completions", {"prompt": [1.5]}, 400, "prompt: must be a string or a list of token ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 9000}, 400, "prompt (2) + max_tokens (9000) = 9002 exceeds"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400,
     "max_tokens (5000) = 5002 tokens, more than the largest"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9000}, 400,
     "+ max_completion_tokens (9000) = "),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature must be"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "seed": -3}, 400, "seed must be"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, 400, "stop must be a list"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop[0] must be a non-empty string"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n: only 1 is supported"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1.1}, 400, "repetition_penalty: only 1 is supported"),
    ("/v1/completions", {"prompt": "hi", "min_p": 0.05}, 400, "min_p: only 0 is supported"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1}}, 400, "logit_bias: only {} is supported"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, 400,
     'response_format: only {"type": "text"} is supported'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools: only [] is supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     'tool_choice: only "none" or "auto" is supported'),
    ("/v1/completions", {"prompt": "hi", "metadata": "x"}, 400, "metadata: must be an object"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k must be an integer >= -1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens must be an integer in [0, max_tokens (4)], got 5"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"usage": True}}, 400,
     "stream_options: only include_usage and continuous_usage_stats"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream: must be true or false"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "unsupported parameter 'frobnicate'"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model 'gpt-4' does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages: must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/nothing", {}, 404, "v1/nothing"),
    ("/v1/models", {}, 405, "no route POST /open/v1/models"),
    ("/v1/completions", b"{" + b" " * (2 << 20) + b"}", 413, "larger than"),
]


PARAMS = {  # the HTTP field an error names in `param` (the body's own names, never max_new_tokens)
    "prompt (2) + max_tokens (9000) = 9002 exceeds": "max_tokens",
    "max_tokens (5000) = 5002 tokens, more than the largest": "max_tokens",
    "+ max_completion_tokens (9000) = ": "max_completion_tokens",
    "max_tokens must be a positive integer": "max_tokens",
    "min_tokens must be an integer in [0, max_tokens (4)], got 5": "min_tokens",
    "top_k must be an integer >= -1": "top_k",
    "repetition_penalty: only 1 is supported": "repetition_penalty",
    "temperature must be": "temperature",
}


@pytest.mark.parametrize("path,body,status,fragment", BAD, ids=[f"{b[0]}:{b[3][:24]}" for b in BAD])
def test_bad_input_is_a_4xx_and_the_server_keeps_serving(running: Running, path: str, body: object,
                                                         status: int, fragment: str) -> None:
    with running.http() as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert fragment in error["message"] and error["code"] == status
        assert error["type"] != "server_error"
        if fragment in PARAMS:
            assert error["param"] == PARAMS[fragment]
        elif error["param"] is not None:  # names a field the client sent, or the one the message names
            root = re.split(r"[.\[]", error["param"])[0]
            assert (isinstance(body, dict) and root in body) or error["message"].startswith(root), error
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_metrics_in_prometheus_format(running: Running) -> None:
    with running.http() as http:
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).raise_for_status()
        text = httpx.get(f"{running.server.url}/metrics", timeout=60).text
    for series in ('raysched_pool_kv_used_ratio{worker="0"}', 'raysched_pool_mamba_slots_used{worker="1"}',
                   'raysched_requests{state="running"}', 'raysched_requests{state="retracted"}',
                   "raysched_retractions_total", "raysched_migrations_total", "raysched_snapshot_bytes_total",
                   'raysched_ttft_seconds_bucket{le="+Inf"}', "raysched_request_latency_seconds_count"):
        assert series in text, series
    finished = next(ln for ln in text.splitlines() if ln.startswith("raysched_requests_finished_total"))
    assert float(finished.split()[-1]) >= 1


def test_scheduler_gone_is_a_503(running: Running) -> None:
    """Last in the module: it ends the scheduler."""
    running.client.stop()
    with running.http() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "is gone" in r.json()["error"]["message"]
        assert http.get(f"{running.server.url}/health").status_code == 503


@pytest.mark.slow
def test_raysched_serve_exits_cleanly_on_sigterm(tmp_path) -> None:
    """The CLI in its own process (own embedded Ray and Serve): answers with the key, then a
    SIGTERM shuts down Serve, the scheduler and Ray, and the process exits with status 0.
    Under `slow`: the default suite signals the whole process group instead, with the same
    key checks (`test_cli_user_errors.py::test_sigterm_to_serves_process_group_exits_promptly`)."""
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    config = tmp_path / "serve.yaml"
    config.write_text("model: tiny\nworkers: 1\npool: {kv_tokens: 256, state_slots: 4}\n")
    env = {**os.environ, "RAYSCHED_API_KEY": KEY}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "raysched.cli", "serve", "--config", str(config),
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None  # it died: stop polling, the asserts below say so
        wait_until(up, 240, "raysched serve to answer /health")
        if proc.poll() is not None:
            pytest.fail(f"raysched serve exited with {proc.returncode}:\n{proc.stdout.read()[-4000:]}")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=60).status_code == 401
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "raysched serve: shutting down" in out
    finally:
        if proc.poll() is None:
            proc.kill()
