"""Shared fixtures: a small multi-node Ray cluster, the in-process reference, leak guards.

    def test_something(multinode_cluster):
        client = raysched.launch(config)        # attaches to the cluster the fixture started
        ...
        client.shutdown()
        wait_for_no_workers()                   # the scheduler's workers really went away

The cluster is one head (1 CPU, no GPU: the driver and the scheduler live there) and two worker
nodes with 1 CPU and 1 fake GPU each. Workers ask for one GPU when the cluster has GPUs, so each
lands on its own node; torch sees no CUDA, so `device: auto` runs them on the CPU. Every node
has its own object store, so snapshots really cross nodes.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator

from contextlib import contextmanager

import pytest
import ray

from raysched.ray_compat import actors
from raysched.sampling import SamplingParams

# Without a GPU, Triton kernels run under Triton's interpreter. It is read when triton and the
# kernels are first imported, so it is set before any test imports them (a test that imported
# them without it, and one that needs it later, cannot share one process otherwise).
if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"

NODE_OBJECT_STORE_BYTES = 100 << 20  # the smallest store Ray accepts is 75 MiB


def reference_tokens(model: str, prompts: list[list[int]], sampling_list: list[SamplingParams],
                     dtype: str = "float32", seed: int = 0) -> list[list[int]]:
    """Output tokens of each request run uninterrupted in this process (`Engine.generate`).

    The pool holds every request's whole budget at once, so nothing is ever retracted. Runs on
    one thread, like a Ray worker with one CPU: on a busy 2-core machine two OpenMP threads made
    this ~25x slower (14 s instead of 0.5 s for the demo workload).
    """
    import torch

    from actors.engine import build_engine

    kv_tokens = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, sampling_list))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = build_engine(model, dtype, "cpu", kv_tokens=kv_tokens, state_slots=len(prompts), seed=seed)
        return engine.generate([list(p) for p in prompts], list(sampling_list))
    finally:
        torch.set_num_threads(threads)


async def stream_token_ids(api, model: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    """The token ids of one streamed completion of `prompt` through an `openai.AsyncOpenAI` client."""
    stream = await api.completions.create(
        model=model, prompt=prompt, max_tokens=sp.max_new_tokens, temperature=sp.temperature, seed=sp.seed,
        stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    return [t async for c in stream for t in c.choices[0].token_ids]


def alive_actors(*class_names: str) -> list[dict]:
    """Actors of these classes in the connected cluster that are not dead yet
    (`raysched.ray_compat.actors`: the GCS actor table, no dashboard needed)."""
    return [a for a in actors(*class_names) if a["state"] != "DEAD"]


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll `condition` until it holds (returns the seconds waited); fail the test naming `what`
    after `timeout_s`. The one waiting helper of the suite: wait for an event, never assert a time."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)  # polling interval of a condition, not a synchronisation guess
    return time.monotonic() - start


def wait_for_no_workers(timeout_s: float = 30.0) -> None:
    """Fail unless every raysched actor (scheduler and workers) is dead and every CPU and GPU of
    the cluster is free again (the resource view lags the actor table a little) in `timeout_s`."""
    def released() -> bool:
        total, free = ray.cluster_resources(), ray.available_resources()
        return (not alive_actors("Scheduler", "Worker")
                and all(free.get(k, 0) == total.get(k, 0) for k in ("CPU", "GPU")))

    wait_until(released, timeout_s, "the raysched actors to exit and free their CPUs and GPUs")


@contextmanager
def local_cluster(gpu_nodes: int, store_bytes: int = NODE_OBJECT_STORE_BYTES) -> Iterator[object]:
    """A `ray.cluster_utils.Cluster`: a head node (1 CPU, no GPU) and `gpu_nodes` nodes with
    1 CPU and 1 fake GPU each, so every worker actor lands on its own node; connected."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "object_store_memory": store_bytes, "include_dashboard": False})
    try:
        for _ in range(gpu_nodes):
            cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=store_bytes)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster
    finally:
        ray.shutdown()  # before cluster.shutdown: removing the driver's node would raise
        cluster.shutdown()


@pytest.fixture(scope="module")
def multinode_cluster() -> Iterator[object]:
    """A 3-node cluster (head + 2 one-GPU nodes), connected for the module."""
    with local_cluster(gpu_nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the module: on a busy 2-core machine two OpenMP threads crawl."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _no_stale_ray() -> Iterator[None]:
    """No Ray connection may leak into, or out of, a test module."""
    if ray.is_initialized():
        warnings.warn("a Ray connection leaked from an earlier test module; shutting it down")
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()
        pytest.fail("this test module left Ray initialised (shut it down in its fixture)")
