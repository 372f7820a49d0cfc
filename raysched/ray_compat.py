"""Every use of Ray's private APIs, in one place, each with a stated fallback (torch-free); also
public Ray calls that a local cluster may refuse (`request_resources`: no autoscaler there).

`ray._private` and `ray.autoscaler._private` change between releases without notice; raysched
is tested with Ray 2.60 (see pyproject). Each function tries the private route first and, when it
is missing or fails, takes the fallback named in its docstring: a public API where one exists,
else an answer the caller can tell apart from a real one (None or an empty dict), never a
made-up number.

    from raysched import ray_compat
    ray_compat.object_store_stats()        # {"object_store_spilled_mib": 0, ...} or {}
    ray_compat.actors("Worker")            # [{"class_name", "state", "pid"}, ...]
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray

INLINE_RETURN_DEFAULT_BYTES = 100 * 1024  # Ray's default `max_direct_call_object_size`
log = logging.getLogger("raysched.ray_compat")


def inline_return_bytes() -> int:
    """Task and actor-call results smaller than this are returned inline, into the caller's own
    process memory, instead of the object store (Ray's `max_direct_call_object_size`).

    Not exposed to Python: read from `RAY_max_direct_call_object_size` (how Ray takes system
    config from the environment) where set. Fallback: Ray's default, 100 KiB.
    """
    raw = os.environ.get("RAY_max_direct_call_object_size", "")
    return int(raw) if raw.isdigit() else INLINE_RETURN_DEFAULT_BYTES


SPILL_PATTERNS = (("object_store_spilled_mib", r"Spilled (\d+) MiB"),
                  ("object_store_restored_mib", r"Restored (\d+) MiB"))


def object_store_stats() -> dict[str, int]:
    """MiB spilled to and restored from disk by this cluster's object stores, so far.

    Private: `ray._private.internal_api.memory_summary` (the text `ray memory --stats-only`
    prints), asked of this cluster's GCS (without an address Ray picks the newest cluster on the
    machine). Fallback: {} (the keys are absent; callers report "unknown", not 0).
    """
    try:
        from ray._private.internal_api import memory_summary

        text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    except Exception:
        return {}
    out = {}
    for key, pattern in SPILL_PATTERNS:
        m = re.search(pattern, text)
        out[key] = int(m.group(1)) if m else 0
    return out


def actors(*class_names: str) -> list[dict[str, Any]]:
    """Actors of these classes in the connected cluster (all of them when none is named), with
    `class_name`, `state` ("ALIVE", "DEAD", ...) and `pid`.

    Private: `ray._private.state.actors()` (the GCS actor table; no dashboard needed).
    Fallback: the public state API `ray.util.state.list_actors`, which needs the dashboard; if
    that fails too, a RuntimeError saying so (an empty list would read as "no actors").
    """
    try:
        rows = [{"class_name": a["ActorClassName"], "state": a["State"], "pid": a.get("Pid")}
                for a in ray._private.state.actors().values()]
    except Exception as private_err:
        rows = _actors_public(private_err)
    return [r for r in rows if not class_names or r["class_name"] in class_names]


def _actors_public(private_err: Exception) -> list[dict[str, Any]]:
    try:
        from ray.util.state import list_actors

        return [{"class_name": a.class_name, "state": a.state, "pid": a.pid}
                for a in list_actors(limit=100_000, raise_on_missing_output=False)]
    except Exception as public_err:
        raise RuntimeError(f"cannot read Ray's actor table: private API failed ({private_err!r}), "
                           f"state API failed ({public_err!r}; it needs the dashboard)") from None


def session_log_dir() -> Path:
    """The `logs` folder of the Ray session this process is connected to.

    Private: `ray._private.worker._global_node.get_session_dir_path()`. Fallback: Ray's default
    `/tmp/ray/session_latest/logs` (right unless a custom temp dir was given to Ray).
    """
    try:
        return Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    except Exception:
        return Path("/tmp/ray/session_latest/logs")


def owned_reference_count() -> int | None:
    """Object references alive in this process's core worker (owned or borrowed).

    Private: `core_worker.get_all_reference_counts()`. Fallback: None (no public equivalent;
    a leak check that gets None must say it could not check).
    """
    try:
        return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())
    except Exception:
        return None


def cluster_config_validator() -> Any:
    """Ray's own `cluster.yaml` schema check: a function(config dict) that raises on a bad
    config (jsonschema.ValidationError), or None when this Ray has none.

    Private: `ray.autoscaler._private.util.prepare_config` + `validate_config`. Fallback: None
    (the caller skips the check and says so).
    """
    try:
        from ray.autoscaler._private import util
    except Exception:
        return None
    return lambda config: util.validate_config(util.prepare_config(config))


AUTH_MODE_ENV = "RAY_AUTH_MODE"


def auth_token_available() -> bool:
    """Whether this process has a Ray auth token at hand ($RAY_AUTH_TOKEN, the file
    $RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token, which any embedded `ray.init` creates).

    Private: `ray._raylet.AuthenticationTokenLoader` (Ray's own lookup). Fallback: those three
    places, checked here.
    """
    try:
        from ray._raylet import AuthenticationTokenLoader

        return bool(AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True))
    except Exception:
        path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
        return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path).is_file()


def set_auth_mode(mode: str) -> None:
    """Set Ray's authentication mode ("token" or "disabled") for this process and the processes
    it starts, as `RAY_AUTH_MODE` does when set before Ray loads its config.

    Private: `ray._raylet.Config.initialize("")`, which re-reads the config (Ray does the same
    when it turns token mode on by itself). Fallback: the environment variable alone (right
    when Ray has not read its config yet in this process).
    """
    os.environ[AUTH_MODE_ENV] = mode
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception:
        pass


def bootstrap_address(address: str) -> str:
    """The host:port of the GCS that `address` ("auto" or host:port) names, as `ray.init` would
    pick it: with "auto", the newest cluster `ray start` recorded on this machine.

    Private: `ray._private.services.canonicalize_bootstrap_address_or_die`; it raises
    ConnectionError when it finds no cluster (or several). Fallback: `address` as given.
    """
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
    except Exception:
        return address
    return canonicalize_bootstrap_address_or_die(address)


@contextlib.contextmanager
def driver_signal_hooks(restore: Callable[[], None]) -> Iterator[None]:
    """While inside: `ray.init` does not install its driver SIGTERM handler (`sys.exit(15)`,
    via `ray._private.utils.set_sigterm_handler`), and `restore` runs right after
    `ray.shutdown` has shut the core worker down (which leaves SIGTERM at its default action at
    the C level), at its next step, `ray._private.state.state.disconnect`.

    Fallback, where either name is missing: that hook is skipped; the caller's own `restore`
    after the block still puts its handlers back, only later.
    """
    try:
        import ray._private.state as ray_state
        import ray._private.utils as ray_utils
    except ImportError:
        yield
        return
    state = getattr(ray_state, "state", None)
    keep_handler = getattr(ray_utils, "set_sigterm_handler", None)
    hook_disconnect = state is not None and callable(getattr(type(state), "disconnect", None))

    def disconnect() -> None:
        type(state).disconnect(state)
        restore()

    if keep_handler is not None:
        ray_utils.set_sigterm_handler = lambda _handler: None
    if hook_disconnect:
        state.disconnect = disconnect
    try:
        yield
    finally:
        if keep_handler is not None:
            ray_utils.set_sigterm_handler = keep_handler
        if hook_disconnect:
            del state.disconnect  # the class's method again


def request_resources(bundles: list[dict[str, float]]) -> bool:
    """Ask the cluster's autoscaler for room for `bundles` in all (each call replaces the last
    request; Ray counts what already runs against it), so a `ray up cluster.yaml` cluster adds
    nodes for workers about to start, and may release them once the request shrinks.

    Public: `ray.autoscaler.sdk.request_resources`, but a cluster without an autoscaler (a local
    `ray.init`, a plain `ray start`) may refuse it. Fallback: the failure is logged and False
    returned; the caller starts its worker anyway (it waits for room, or fails to start).
    """
    try:
        from ray.autoscaler.sdk import request_resources as ray_request_resources

        ray_request_resources(bundles=bundles)
        return True
    except Exception as err:
        log.info("no autoscaler took the resource request (%r); going on without", err)
        return False
