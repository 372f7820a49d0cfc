"""Prefill and decode roles under the OpenAI-compatible server (Ray Serve on the loopback).

One server with `roles: {prefill: 1, decode: 1}`: concurrent streamed completions (greedy and
seeded-sampled) give the tokens of the independent in-process reference (colocated, one engine)
and every one is handed over; a second chat turn restores the first turn's parked state on the
prefill worker; `/metrics` and `raysched status` show the roles. Serve takes a while to start on
a busy machine: marker `slow`.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Iterator

import openai
import pytest

import raysched
from raysched import cli
from raysched.config import load_serve_config
from raysched.sampling import SamplingParams
from raysched.serve import deploy_app, start_server
from tests.conftest import reference_tokens, stream_token_ids, wait_until

pytestmark = pytest.mark.slow
NAME = "test-pd-serve"
CONFIG = {"model": "tiny", "roles": {"prefill": 1, "decode": 1}, "pool": {"kv_tokens": 4096, "state_slots": 16}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def running() -> Iterator[tuple[str, raysched.Client]]:
    server = start_server(load_serve_config(CONFIG), port=_free_port(), api_key=None, name=NAME, num_cpus=3)
    try:
        deploy_app(NAME, api_key=None, app_name="open", route_prefix="/open")
        yield f"{server.url}/open", raysched.connect(name=NAME)
    finally:
        server.stop()


def test_streams_under_roles_are_token_exact_and_handed_over(running) -> None:
    url, client = running
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(4, 40))] for _ in range(12)]
    params = [SamplingParams(max_new_tokens=rng.randint(8, 24), temperature=0.8 * (i % 2), seed=i) for i in range(12)]
    expected = reference_tokens("tiny", prompts, params)
    before = client.stats()["handovers"]

    async def all_of_them() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300) as api:
            return await asyncio.gather(*[stream_token_ids(api, "tiny", p, sp) for p, sp in zip(prompts, params)])

    assert asyncio.run(all_of_them()) == expected
    stats = client.stats()
    assert stats["handovers"] - before == len(prompts)
    assert [w["role"] for w in stats["workers"]] == ["prefill", "decode"]
    wait_until(lambda: client.check_idle()["workers_idle"], 60, "the workers to be idle")


def test_second_chat_turn_hits_the_turn_cache_under_roles(running) -> None:
    """The second turn restores the first turn's parked state (a turn-cache hit) on the prefill
    worker (under roles only it admits), is handed over to the decode worker, and its text is
    the independent reference's: the in-process engine from the prompt the chat template gives,
    with no cache at all. Control: the first turn, with nothing parked, is not a hit."""
    from raysched.tokenizer import load_tokenizer, with_eos_stop

    url, client = running
    tok = load_tokenizer("tiny")
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Tell me about the scheduler and its workers, " * 6}]
    hits = client.stats()["state_cache_hits"]
    first = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    before = client.stats()
    assert before["state_cache_hits"] == hits
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    after = client.stats()
    assert after["state_cache_hits"] == before["state_cache_hits"] + 1
    assert after["handovers"] == before["handovers"] + 1
    prompt = tok.encode(tok.chat_prompt(messages))
    params = SamplingParams.from_dict(with_eos_stop({"max_new_tokens": 8, "temperature": 0}, tok))
    want = reference_tokens("tiny", [prompt], [params])[0]
    assert second.choices[0].message.content == tok.decode(want)


def test_status_and_metrics_show_roles(running, capsys) -> None:
    url, client = running
    cli.format_status(client.workers, client.stats())
    out = capsys.readouterr().out
    assert "worker 0: role prefill" in out and "worker 1: role decode" in out and "hand-overs" in out
    import httpx

    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    assert 'raysched_worker_role{role="prefill",worker="0"} 1.0' in metrics
    assert "raysched_handovers_total" in metrics
