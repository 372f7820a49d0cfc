"""Connecting this process to Ray (torch-free): an embedded local instance, or a running cluster
at an address. The one path of `launch`, `connect` and `raysched run / start / status / stop /
serve`.

    owns_ray = init_ray(None, num_cpus=3, object_store_bytes=512 << 20)   # embedded, or RAY_ADDRESS
    attach("127.0.0.1:6379")        # a cluster that answers within 5 s, or one ClusterError line

What is Ray's, and what is done about it here:
- Token authentication. A new local instance (any embedded `ray.init`, e.g. the demo) turns on
  Ray's token auth and writes the token to `~/.ray/auth_token`; from then on `ray start --head`
  turns it on too. Ray 2.60 clients turn it on by themselves only with `address="auto"`: with
  an explicit address they connect without the token and fail after ~20 s
  (`AuthenticationError`). `attach` therefore runs this process in token mode whenever
  `RAY_AUTH_MODE` is unset and a token is at hand (a cluster without auth accepts such a client
  too); `RAY_AUTH_MODE` set by the user always wins. An embedded start sets token mode
  explicitly (Ray's own default there), which also spares every command Ray's warning about it.
- Unreachable addresses. `ray.init` to an address where nothing listens retries for ever;
  `attach` first opens a TCP connection to the cluster's GCS with a short timeout.
- What an embedded instance runs. `include_dashboard=False` drops the dashboard's web UI and its
  modules (nothing answers on port 8265), but Ray 2.60 still starts, on every head node, its API
  server process (`dashboard.py --modules-to-load=UsageStatsHead --disable-frontend`), and on every
  node the dashboard agent (it exports the metrics) and the runtime-env agent, besides the GCS,
  the raylet, the autoscaler monitor and the log monitor; no `ray.init` option or environment
  variable turns those off (measured: ~0.5 GB of RSS for the Python ones).
- What a driver prints. Ray copies onto a driver's stderr the output of its job's workers and the
  cluster daemons' warnings (e.g. the raylet's "... is over 95% full" every few seconds while a
  disk is nearly full). `raysched start / status / scale / drain / stop` only talk to a
  deployment started elsewhere: they own no worker whose output they should show, and the
  daemons' lines would break their one-line errors, so they attach with `log_to_driver=False`
  (the lines stay in the cluster's logs, `ray logs`). A driver's `connect` keeps Ray's default
  unless asked (its own Ray tasks' output is its to see).
"""

from __future__ import annotations

import os
import socket

import ray

from raysched import interrupts, ray_compat

REACH_TIMEOUT_S = 5.0  # how long a cluster's GCS port may take to accept a connection
DEFAULT_OBJECT_STORE_BYTES = 512 << 20  # the embedded instance's object store


class ClusterError(ConnectionError):
    """No Ray cluster at the address, or it refused this process; the message is one line."""


class PortInUseError(RuntimeError):
    """The HTTP port `raysched serve` was asked for is taken (checked before anything starts)."""


def init_ray(address: str | None, num_cpus: int, object_store_bytes: int | None = None) -> bool:
    """Connect this process to Ray unless it already is; returns whether it connected now (and
    so owns the connection: `ray.shutdown()` is its to call). With `address` or $RAY_ADDRESS it
    attaches to that cluster, otherwise it starts an embedded local instance (no dashboard web
    UI, `num_cpus`, a bounded object store)."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        attach(address)
    else:
        start_embedded(num_cpus, object_store_bytes or DEFAULT_OBJECT_STORE_BYTES)
    return True


def shutdown_ray() -> None:
    """`ray.shutdown()`, which a signal does not cut short (see `interrupts.holding`)."""
    with interrupts.holding():
        ray.shutdown()


def start_embedded(num_cpus: int, object_store_bytes: int) -> None:
    """A private local Ray instance for this process (ended by `ray.shutdown()`)."""
    if ray_compat.AUTH_MODE_ENV not in os.environ:
        ray_compat.set_auth_mode("token")  # what Ray picks for a new instance, said explicitly
    try:
        ray.init(address="local", include_dashboard=False, num_cpus=num_cpus,
                 object_store_memory=object_store_bytes, logging_level="WARNING")
    except Exception as err:  # e.g. Ray's "node timed out during startup" on an overloaded machine
        shutdown_ray()  # whatever of it did start
        raise ClusterError(f"could not start a local Ray instance: {_first_line(err)}") from None


def attach(address: str, log_to_driver: bool = True) -> None:
    """Connect to the running cluster at `address` (host:port, "auto" for the newest one on this
    machine, or a ray:// client address); `log_to_driver=False` for a client of a deployment
    started elsewhere (see above). Raises ClusterError, in one line, when none answers within
    REACH_TIMEOUT_S or it refuses this process."""
    if not address.startswith("ray://"):
        check_reachable(_gcs_address(address), address)
    if ray_compat.AUTH_MODE_ENV not in os.environ and ray_compat.auth_token_available():
        ray_compat.set_auth_mode("token")
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=log_to_driver)
    except ray.exceptions.AuthenticationError as err:
        raise ClusterError(f"the Ray cluster at {address} refused this process: {_first_line(err)} (a cluster "
                           f"with token auth needs its token: $RAY_AUTH_TOKEN or ~/.ray/auth_token)") from None
    except ConnectionError as err:
        raise ClusterError(f"cannot connect to the Ray cluster at {address}: {_first_line(err)}") from None


def _gcs_address(address: str) -> str:
    """host:port of the cluster `address` names ("auto": the newest `ray start` on this machine)."""
    try:
        return ray_compat.bootstrap_address(address)
    except ConnectionError as err:
        raise ClusterError(f"no Ray cluster found for address {address!r}: {_first_line(err)} "
                           f"(start one with `ray start --head`, or pass --address HOST:PORT)") from None


def check_reachable(gcs: str, address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise ClusterError unless something accepts a TCP connection at `gcs` (host:port) within
    `timeout_s`. `address` is what the user gave, for the message."""
    host, sep, port = gcs.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterError(f"Ray address {address!r} is not HOST:PORT or 'auto'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        reason = f"no answer within {timeout_s:.0f} s" if isinstance(err, TimeoutError) else (
            (err.strerror or str(err)).lower())
        raise ClusterError(f"no Ray cluster answers at {address} ({gcs}: {reason})") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError unless this process could listen on host:port now (the server binds
    it only once Ray and the scheduler are up: a taken port must be found before that)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as err:
            raise PortInUseError(f"cannot listen on {host}:{port}: {err.strerror or err} "
                                 f"(another server there? pick another --port)") from None
