"""Running commands the way a person does: a subprocess, a fresh HOME, no inherited RAY_* variables.

    home = tmp_path / "home"
    proc = raysched("status", "--address", f"127.0.0.1:{free_port()}", home=home)
    with RayHead(home) as head:                    # `ray start --head` on a free port, ended after
        raysched("start", "--config", SERVE_YAML, "--address", head.address, home=home)

The test process's own `ray.init` puts RAY_AUTH_MODE (and more) into its environment; a
subprocess that inherited it would hide what a user meets in a new shell, so every RAY_*
variable is stripped. `RayHead` ends only the processes its own `ray start` began (they share
one session id): `ray stop` would end every Ray cluster of this user on the machine.

A new home shares this machine's kernel cache (rowdot's compiled builds and the measured kernel
choice: per machine, not per home), as for a person who ran raysched on it before; a home given
to `first_run_home` gets its own, as on a machine's first run (the README walk uses one).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
_SCRIPT = BIN / "raysched"  # the console script, as a user runs it
RAYSCHED = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "raysched.cli"]
SERVE_YAML = REPO / "examples" / "serve.yaml"  # the README's serve config (pools for real prompts)
DEMO_YAML = REPO / "examples" / "demo.yaml"  # the demo's small pools: requests retract and move
WORKLOAD_YAML = REPO / "examples" / "workload.yaml"
STORE_BYTES = 100 << 20  # object store of a test head (the smallest Ray accepts is 75 MiB)


_FIRST_RUN_HOMES: set[Path] = set()


def first_run_home(home: Path) -> Path:
    """`home`, for `user_env`, as on a machine where raysched never ran: no kernel cache yet."""
    _FIRST_RUN_HOMES.add(home.resolve())
    return home


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment as a new shell of a user whose home is `home` would have it: no RAY_*
    variables, OMP_NUM_THREADS=1 (as in a Ray worker; two threads on a busy 2-core box crawl),
    and this machine's kernel cache unless `home` is a `first_run_home` (see the module doc)."""
    from actors.kernel_choice import cache_file

    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "RAYSCHED_KERNEL_CACHE"}
    machine_cache = cache_file()
    if home.resolve() not in _FIRST_RUN_HOMES and machine_cache is not None:
        env["RAYSCHED_KERNEL_CACHE"] = str(machine_cache.parent)
    env.update(HOME=str(home), OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", **extra)
    return env


def raysched(*args: object, home: Path, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess:
    """`raysched ARGS` in a subprocess (cwd: the repository), as a user in a fresh shell runs it."""
    return subprocess.run([*RAYSCHED, *map(str, args)], cwd=REPO, env=user_env(home, **env),
                          capture_output=True, text=True, timeout=timeout_s)


def python(code: str, home: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`python -c CODE` in a subprocess, as `raysched` above."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=user_env(home), capture_output=True,
                          text=True, timeout=timeout_s)


def free_port() -> int:
    """A TCP port nothing listens on now (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line_error(proc: subprocess.CompletedProcess, command: str) -> str:
    """Assert that `proc` failed with exit status 2 and exactly one line on stderr, naming the
    command (`raysched <command>: error: ...`); returns that line."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(f"raysched {command}: error: "), proc.stderr[-3000:]
    return lines[0]


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


def end_session(sid: int, grace_s: float = 3.0) -> None:
    """SIGTERM every process of session `sid`, then SIGKILL what is left after `grace_s` (a test
    head's GCS, raylet and autoscaler take over 10 s to go on SIGTERM alone: their state is
    thrown away with the head's temp dir)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)  # polls the processes' exit
        if not session_pids(sid):
            return


class RayHead:
    """`ray start --head` on a free port with its own temp dir, in a session of its own, as a
    user in `home` starts it; `address` is 127.0.0.1:<port>. Leaving the block ends exactly the
    processes of that session (the head's daemons and every worker its raylet started); `env`:
    more variables for the head's daemons."""

    def __init__(self, home: Path, num_cpus: int = 3, env: dict[str, str] | None = None) -> None:
        self.home, self.num_cpus, self.env = home, num_cpus, env or {}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="rh-", dir="/tmp")  # short: Ray's socket paths have a limit
        self.sid: int | None = None

    def __enter__(self) -> "RayHead":
        proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}",
             f"--num-cpus={self.num_cpus}", "--num-gpus=0", f"--object-store-memory={STORE_BYTES}",
             "--include-dashboard=false", "--disable-usage-stats"],
            env=user_env(self.home, **self.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.sid = proc.pid  # a new session's id is its leader's pid; the daemons stay in it
        out, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            self.__exit__()
            raise RuntimeError(f"ray start --head failed ({proc.returncode}):\n{out[-3000:]}")
        self.output = out
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sid is not None:
            end_session(self.sid)
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # its session logs and sockets
