"""`raysched serve` across a scheduler restart: the requests in flight when the scheduler's
process dies (a `kill_scheduler` fault) continue exactly, streamed or not.

The replica submits each of them again to the scheduler Ray restarts, with the tokens its client
has received (`OpenAIServer._resubmit`, as a `Client` does with `RequestHandle.resubmit`): the
request resumes by recompute and the counter-based sampler goes on at its draw number, so every
answer equals the uninterrupted in-process run. Found with guidellm: before, the 6 requests in
flight at the kill ended in an error (42 of 48 completed)."""

from __future__ import annotations

import asyncio
import random

import openai
import ray

import raysched
from raysched.config import load_serve_config
from raysched.sampling import SamplingParams
from raysched.serve import start_server
from tests.conftest import reference_tokens, stream_token_ids
from tests.user_cli import free_port

NAME = "raysched-restart-test"
CONFIG = {"model": "tiny", "workers": 2, "pool": {"kv_tokens": 4096, "state_slots": 16},
          "scheduler": {"fold_calls": 2},  # short calls: worker 0 makes its 4th long before the answers end
          "faults": [{"kind": "kill_scheduler", "worker": 0, "after_steps": 4}]}


async def _completion_ids(api: openai.AsyncOpenAI, prompt: list[int], sp: SamplingParams) -> list[int]:
    out = await api.completions.create(model="tiny", prompt=prompt, max_tokens=sp.max_new_tokens,
                                       temperature=sp.temperature, seed=sp.seed,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    return list(out.choices[0].token_ids)  # type: ignore[attr-defined]


def test_requests_in_flight_continue_exactly_across_a_scheduler_restart() -> None:
    """12 requests (half streamed, half not, greedy and sampled) while the scheduler's process
    exits after worker 0's 4th call: every answer equals the in-process reference. Control:
    the scheduler did restart, and the replica submitted requests to it again."""
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(8, 40))] for _ in range(12)]
    params = [SamplingParams(max_new_tokens=rng.randint(40, 60), temperature=0.8 * (i % 2), seed=i) for i in range(12)]
    expected = reference_tokens("tiny", prompts, params)
    server = start_server(load_serve_config(CONFIG), port=free_port(), name=NAME, num_cpus=3)
    try:
        async def all_of_them() -> list[list[int]]:
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300) as api:
                return await asyncio.gather(*[(stream_token_ids(api, "tiny", p, sp) if i % 2 else _completion_ids(api, p, sp))
                                              for i, (p, sp) in enumerate(zip(prompts, params))])

        got = asyncio.run(all_of_them())
        stats = raysched.connect(name=NAME).stats()
    finally:
        server.stop()
    assert not ray.is_initialized()
    assert got == expected
    assert stats["scheduler_restarted"] is True and stats["resubmitted"] > 0, stats
