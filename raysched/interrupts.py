"""How a `raysched` command meets SIGINT (Ctrl-C) and SIGTERM: it stops, cleans up what it
started, prints one line, and exits 128 + the signal.

    install()                      # at the command's start: a signal raises Interrupted
    with holding():                # Ray's start-up: a signal is only recorded ...
        client = raysched.launch(config)
    try:
        raise_if_signalled()       # ... and raised here, where the caller can clean up
        ...
    finally:
        client.shutdown()

Why `holding` and the checkpoints: a KeyboardInterrupt raised in the middle of `ray.init` (its core worker half
connected) can crash the process at exit (SIGSEGV, measured), and `ray.init` installs a SIGTERM
handler of its own in the driver (`sys.exit(15)`: a quiet exit, nothing cleaned up), and its core
worker one at the C level (abort, with a stack dump). Inside `holding` the first signal is
recorded and Ray's Python handler is not installed; a second signal raises at once (for a
start-up that hangs). `launch` and `start_server` call `raise_if_signalled` right after Ray is up,
which puts our handlers back and acts on a signal held back.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the signals received, first first (Ray code may re-raise a plain KeyboardInterrupt)
_holding = [0]  # the depth of `holding` blocks
_installed = [False]


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: the command stops, cleans up, and exits 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def signalled() -> int | None:
    """The first SIGINT or SIGTERM this command received, if any."""
    return _received[0] if _received else None


def _handler(signum: int, _frame: Any) -> None:
    _received.append(signum)
    if not (_holding[0] and len(_received) == 1):
        raise Interrupted(signum)


def install() -> None:
    """From now on SIGINT and SIGTERM raise `Interrupted` in the main thread (outside `holding`)."""
    _installed[0] = True
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def raise_if_signalled() -> None:
    """A checkpoint after a step of Ray's start-up: raise `Interrupted` if a signal came (while
    `holding` held it back), after putting our handlers back (`restore`). In a library user's
    process (no `install`) it does nothing."""
    restore()
    if _received:
        raise Interrupted(_received[0])


def restore() -> None:
    """Put our handlers back where `install` was called (after Ray changed them at the C level:
    its core worker's start installs an aborting SIGTERM handler, and `ray.shutdown` leaves
    SIGTERM at the default action, which would end the process without a clean-up)."""
    if _installed[0]:
        install()


@contextlib.contextmanager
def holding() -> Iterator[None]:
    """Around a start-up or a shut-down of Ray, in a command that called `install`: the first
    signal is recorded, not raised (see the module doc); the caller acts on it at its next
    `raise_if_signalled`. Ray's driver SIGTERM handler is not installed, and our handlers go back
    right after the core worker's shut-down, not only at the end: in between, SIGTERM would end
    the process at once (`ray_compat.driver_signal_hooks`). Nests; elsewhere it does nothing."""
    if not _installed[0] or _holding[0]:
        _holding[0] += 1 if _installed[0] else 0
        try:
            yield
        finally:
            _holding[0] -= 1 if _installed[0] else 0
        return
    from raysched import ray_compat

    with ray_compat.driver_signal_hooks(restore):
        _holding[0] = 1
        try:
            restore()
            yield
        finally:
            _holding[0] = 0
            restore()
