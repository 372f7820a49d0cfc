"""The scheduler as a named Ray actor: create it, find it, end it (torch-free).

One long-lived deployment is one scheduler actor named in the `raysched` namespace; `raysched
serve`, drivers calling `raysched.connect(address)`, `raysched status` and `raysched stop` all find
it by that name. `raysched.launch` creates an unnamed one by default, so several launches can
share a cluster.

    from raysched.deployment import start_scheduler, find_scheduler
    handle, workers = start_scheduler(config, name="raysched", detached=True)
    assert find_scheduler("raysched") is not None
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysched.config import ConfigError, ServeConfig

NAMESPACE = "raysched"
DEFAULT_NAME = "raysched"
DEFAULT_MAX_RESTARTS = 3  # Ray re-creates a scheduler whose process died; clients resubmit to it


class SchedulerExistsError(RuntimeError):
    """A live scheduler already holds this name; connect to it or stop it first."""


class SchedulerNotFoundError(RuntimeError):
    """No scheduler with this name runs in the cluster."""


def find_scheduler(name: str = DEFAULT_NAME) -> Any | None:
    """The handle of the live scheduler named `name` in namespace `raysched`, or None."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def scheduler_options(name: str | None = None, detached: bool = False,
                      max_restarts: int = DEFAULT_MAX_RESTARTS) -> dict:
    """Ray actor options for the scheduler: on this (the driver's) node, no CPU of its own, many
    concurrent calls (it is async); with `name`, registered in namespace `raysched`."""
    here = ray.get_runtime_context().get_node_id()
    opts: dict[str, Any] = {
        "num_cpus": 0, "max_concurrency": 10000, "max_restarts": max_restarts,
        "enable_task_events": False,  # no per-call event records in a process that serves every call
        "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}
    if name is not None:
        opts.update(name=name, namespace=NAMESPACE)
    if detached:
        if name is None:
            raise ValueError("a detached scheduler needs a name (nothing could find it otherwise)")
        opts["lifetime"] = "detached"
    return opts


def start_scheduler(config: ServeConfig, name: str | None = None, detached: bool = False,
                    max_restarts: int = DEFAULT_MAX_RESTARTS, exist_ok: bool = False) -> tuple[Any, list[dict]]:
    """Create the scheduler actor, start its workers; returns (handle, one dict per worker).

    With `name`, a live scheduler already under that name raises `SchedulerExistsError`, or with
    `exist_ok` is returned as is (its own config stands). `detached` lets it outlive this driver
    (`stop_scheduler` ends it). `max_restarts` is passed to Ray: a restarted scheduler starts new
    workers (the old ones died with it, their owner) and clients resubmit to it. A worker that cannot start
    (e.g. a missing checkpoint) raises ConfigError in one line, and nothing is left behind.
    """
    if name is not None:
        existing = find_scheduler(name)
        if existing is not None:
            if not exist_ok:
                raise SchedulerExistsError(f"a raysched scheduler named {name!r} already runs in this "
                                           f"cluster; connect to it or stop it first (raysched stop)")
            return existing, describe(existing)["workers"]
    from raysched.scheduler import Scheduler

    opts = scheduler_options(name, detached, max_restarts)
    sched = None
    try:
        sched = ray.remote(Scheduler).options(**opts).remote(config)
        workers = ray.get(sched.start.remote())
    except BaseException as err:
        if sched is not None:
            ray.kill(sched, no_restart=True)  # on a shared cluster it (and its workers) would linger
        if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, ConfigError):
            raise err.cause from None  # e.g. a missing checkpoint: one line, not Ray's traceback
        raise
    return sched, workers


def describe(handle: Any) -> dict:
    """{"config": ServeConfig, "workers": [...]} of a running scheduler."""
    return ray.get(handle.describe.remote())


def stop_scheduler(handle: Any, timeout_s: float = 30.0) -> None:
    """End a scheduler and its workers for good (no restart)."""
    try:
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    except Exception:
        pass  # already dead, or stuck: the kill below ends it either way
    ray.kill(handle, no_restart=True)
