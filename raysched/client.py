"""The driver API: start (or attach to) Ray, start the scheduler, submit requests.

    import raysched
    client = raysched.launch("examples/serve.yaml")        # embedded local Ray by default
    handle = client.submit([5, 17, 42], {"max_new_tokens": 8})
    print(handle.result()["token_ids"])
    client.shutdown()
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysched.config import ConfigError, ServeConfig, load_serve_config
from raysched.sampling import RequestError, SamplingParams

DEFAULT_OBJECT_STORE_BYTES = 512 << 20


class SchedulerDiedError(RuntimeError):
    """The scheduler actor is gone; pending requests cannot complete through it."""


def _get(ref: Any, timeout: float | None = None) -> Any:
    """ray.get, turning the scheduler's death into a SchedulerDiedError and a rejected request
    into the plain RequestError the scheduler raised (its message, without Ray's traceback)."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayActorError as err:
        raise SchedulerDiedError(f"the raysched scheduler actor died: {err}") from None
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, RequestError):
            raise err.cause from None
        raise


def launch(config: ServeConfig | str | Mapping[str, Any] | None = None, address: str | None = None,
           num_cpus: int | None = None) -> "Client":
    """Start the scheduler and its workers; returns a `Client`.

    With `address` (or RAY_ADDRESS) it attaches to that cluster; otherwise it starts an embedded
    local Ray instance (no dashboard, bounded object store) that `Client.shutdown` stops again.
    If Ray is already initialised in this process, that instance is used as is.
    """
    cfg = config if isinstance(config, ServeConfig) else load_serve_config(config or {})
    owns_ray = _init_ray(cfg, address, num_cpus)
    sched = None
    try:
        here = ray.get_runtime_context().get_node_id()
        from raysched.scheduler import Scheduler

        sched = ray.remote(Scheduler).options(
            num_cpus=0, max_concurrency=10000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(cfg)
        workers = ray.get(sched.start.remote())
    except BaseException as err:
        if sched is not None:
            ray.kill(sched)  # on a shared cluster it (and its workers) would otherwise linger
        if owns_ray:
            ray.shutdown()
        if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, ConfigError):
            raise err.cause from None  # e.g. a missing checkpoint: one line, not Ray's traceback
        raise
    return Client(sched, cfg, workers, owns_ray)


def _init_ray(cfg: ServeConfig, address: str | None, num_cpus: int | None) -> bool:
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level="WARNING")
    else:
        ray.init(address="local", include_dashboard=False, num_cpus=num_cpus or max(2, cfg.workers + 1),
                 object_store_memory=cfg.object_store_memory or DEFAULT_OBJECT_STORE_BYTES,
                 logging_level="WARNING")
    return True


class Client:
    def __init__(self, scheduler: Any, config: ServeConfig, workers: list[dict], owns_ray: bool) -> None:
        self.scheduler = scheduler
        self.config = config
        self.workers = workers  # one dict per worker: node, device, pool sizes
        self._owns_ray = owns_ray

    def submit(self, prompt_ids: list[int], sampling: SamplingParams | Mapping[str, Any] | None = None,
               request_id: str | None = None, priority: int = 0) -> "RequestHandle":
        """Queue a request. Invalid input raises `RequestError` here, before anything is allocated.
        `priority`: lower is more urgent (default 0); a more urgent request that finds no room
        preempts the least urgent running ones (see `scheduler.preemption`).

        >>> h = client.submit([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.7, "seed": 1})
        >>> urgent = client.submit([4, 5], {"max_new_tokens": 4}, priority=-1)
        """
        params = sampling.to_dict() if isinstance(sampling, SamplingParams) else dict(sampling or {})
        rid = _get(self.scheduler.submit.remote(list(prompt_ids), params, request_id, priority))
        return RequestHandle(self.scheduler, rid)

    def vocab_size(self) -> int:
        return self.workers[0]["vocab_size"]

    def stats(self, detail: bool = False) -> dict:
        return _get(self.scheduler.stats.remote(detail))

    def timeline(self) -> list[tuple]:
        return _get(self.scheduler.timeline.remote())

    def check_idle(self) -> dict:
        """Whether every worker pool and every scheduler table is empty."""
        return _get(self.scheduler.check_idle.remote())

    def shutdown(self) -> None:
        """Stop the scheduler and workers; stop Ray too if `launch` started it."""
        try:
            ray.get(self.scheduler.shutdown.remote(), timeout=30)
        except Exception:
            pass
        ray.kill(self.scheduler)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class RequestHandle:
    def __init__(self, scheduler: Any, request_id: str) -> None:
        self.scheduler = scheduler
        self.request_id = request_id

    def result(self, timeout: float | None = None) -> dict:
        """Block until the request ends; its record (token_ids, workers, retractions, timings)."""
        return _get(self.scheduler.wait.remote(self.request_id), timeout)

    def stream(self) -> Iterator[int]:
        """Yield tokens as they are generated."""
        cursor, done = 0, False
        while not done:
            tokens, done = _get(self.scheduler.next_tokens.remote(self.request_id, cursor))
            cursor += len(tokens)
            yield from tokens

    def abort(self) -> bool:
        return _get(self.scheduler.abort.remote(self.request_id))
