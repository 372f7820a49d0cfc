"""`raysched.background.detached_task`: a task that outlives the call that made it.

The event loop holds its tasks only weakly: a task whose awaited future nobody else holds is
garbage once nothing refers to it, and the collector destroys it while it is pending (asyncio's
"Task was destroyed but it is pending!"). A scheduler's worker replacement ran in such a task.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import weakref

from raysched.background import detached_task

CALLER = contextvars.ContextVar("caller", default=None)


async def _waits_for_ever() -> None:
    await asyncio.get_running_loop().create_future()  # a future only this task refers to


def _survives_a_collection(start) -> bool:
    """Whether a task `start` makes (and nobody keeps) is still alive after gc.collect()."""
    async def run() -> bool:
        ref = weakref.ref(start(_waits_for_ever()))
        await asyncio.sleep(0)  # the task runs up to its await
        gc.collect()
        task = ref()
        if task is not None:
            task.cancel()
        return task is not None

    return asyncio.run(run())


def test_a_detached_task_nobody_keeps_is_not_collected_while_it_runs() -> None:
    """Control: a plain `create_task` that nobody keeps is collected mid-flight (the loss the
    held reference prevents)."""
    assert _survives_a_collection(detached_task)
    assert not _survives_a_collection(lambda coro: asyncio.get_running_loop().create_task(coro))


def test_a_detached_task_runs_in_a_context_of_its_own() -> None:
    """The caller's context variables (Ray's record of which call a task belongs to is one) do
    not reach it. Control: a plain `create_task` copies them."""
    async def seen_by(start) -> object:
        CALLER.set("handler")
        return await start(_caller())

    async def _caller() -> object:
        return CALLER.get()

    assert asyncio.run(seen_by(detached_task)) is None
    assert asyncio.run(seen_by(lambda coro: asyncio.get_running_loop().create_task(coro))) == "handler"
