"""Long-lived asyncio tasks in actors: `detached_task` (torch-free, no Ray import).

A task made with `loop.create_task` copies the context of the call running at that moment, and
Ray counts the calls such a task makes as that call's children: when the call is cancelled
recursively (Ray Serve cancels a handler whose HTTP client left, and with it the scheduler call
the handler was awaiting), Ray cancels them too, long after the call itself is over. Found twice:
a replica's sink poll, started by its first stream, ended every stream when that client left;
a restarted scheduler, started by its first submit, stayed broken when that submit's caller
went. Every task that outlives the call that made it (loops, background work) starts here.

The event loop keeps only weak references to its tasks, so a task nobody holds may be collected
before it ends (asyncio's docs say to keep one): `detached_task` holds each until it is done.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any


_RUNNING: set[asyncio.Task] = set()  # every detached task until it ends (see the module)


def detached_task(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Run `coro` as a task of the running loop, in a context of its own, held until it ends
    (see the module)."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return task
