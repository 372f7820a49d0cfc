"""The README's long-lived path, after the demo, in a fresh HOME, as a user types it.

An embedded run first (as `bash examples/demo.sh` does): Ray writes ~/.ray/auth_token. Then
`ray start --head` turns on token auth, and every command with an explicit `--address` must
still work (Ray's clients do not pass the token by themselves with an explicit address; see
`raysched.cluster`): `raysched start`, `status`, `raysched.connect`, `serve --address` (which
refuses another config, and on exit deletes only its own Serve application), `stop`. Each runs
in a subprocess with no RAY_* variable inherited from this test process.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from raysched.sampling import SamplingParams
from tests.conftest import reference_tokens, wait_until
from tests.user_cli import (RAYSCHED, REPO, RayHead, first_run_home, free_port, one_line_error, python, raysched,
                            user_env)

CONFIG = "model: tiny\nworkers: 1\npool: {kv_tokens: 256, state_slots: 4}\n"
PROMPT, MAX_NEW = [5, 17, 42, 7], 6


def _connect_and_submit(address: str) -> str:
    return (f"import json, raysched\n"
            f"client = raysched.connect({address!r})\n"
            f"print(json.dumps(client.submit({PROMPT}, {{'max_new_tokens': {MAX_NEW}}}).result()['token_ids']))\n"
            f"client.shutdown()\n")


def _serve(config: Path, address: str, port: int, home: Path) -> subprocess.Popen:
    return subprocess.Popen([*RAYSCHED, "serve", "--config", str(config), "--address", address, "--port", str(port)],
                            cwd=REPO, env=user_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _answers(url: str, proc: subprocess.Popen) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return proc.poll() is not None  # it died: stop polling, the caller says so


def test_readme_long_lived_path_after_an_embedded_run(tmp_path: Path) -> None:
    home = first_run_home(tmp_path / "home")  # rowdot compiled and kernels measured under it
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    embedded = python("import ray; from raysched.cluster import init_ray\n"
                      "init_ray(None, num_cpus=1, object_store_bytes=80 << 20); ray.shutdown()", home)
    assert embedded.returncode == 0, embedded.stderr[-3000:]
    assert (home / ".ray" / "auth_token").is_file()  # what makes the next `ray start` require a token
    assert "Token authentication" not in embedded.stderr  # the mode is set explicitly: no warning
    with RayHead(home) as head:
        started = raysched("start", "--config", config, "--address", head.address, home=home, timeout_s=240)
        assert started.returncode == 0, started.stderr[-3000:]
        assert "scheduler 'raysched' started" in started.stdout
        assert list((home / ".cache" / "raysched").glob("kernel-choice-*.json")), "a first run measures its kernels"
        status = raysched("status", "--address", head.address, home=home)
        assert status.returncode == 0 and "worker 0:" in status.stdout, status.stderr[-3000:]
        connected = python(_connect_and_submit(head.address), home)
        assert connected.returncode == 0, connected.stderr[-3000:]
        want = reference_tokens("tiny", [PROMPT], [SamplingParams(max_new_tokens=MAX_NEW)])[0]
        assert json.loads(connected.stdout.splitlines()[-1]) == want

        other = tmp_path / "other.yaml"
        other.write_text(CONFIG.replace("model: tiny", "model: tiny-granite"))
        refused = raysched("serve", "--config", other, "--address", head.address, "--port", free_port(), home=home)
        line = one_line_error(refused, "serve")
        assert "serves model 'tiny'" in line and "(model 'tiny-granite')" in line

        port = free_port()
        server = _serve(config, head.address, port, home)
        try:
            wait_until(lambda: _answers(f"http://127.0.0.1:{port}", server), 240, "raysched serve --address to answer")
            assert server.poll() is None, server.stdout.read()[-3000:]
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
            server.send_signal(signal.SIGTERM)
            out, _ = server.communicate(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
        assert server.returncode == 0, out[-3000:]
        assert "graceful_shutdown failed" not in out and "Traceback" not in out, out[-3000:]
        apps = python(f"import ray; from ray import serve; from raysched.cluster import attach\n"
                      f"attach({head.address!r}); print(sorted(serve.status().applications))", home)
        assert apps.returncode == 0 and apps.stdout.strip().splitlines()[-1] == "[]", apps.stderr[-2000:]

        still = raysched("status", "--address", head.address, home=home)  # the scheduler outlived serve
        assert still.returncode == 0 and "worker 0:" in still.stdout, still.stderr[-3000:]
        stopped = raysched("stop", "--address", head.address, home=home)
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr[-3000:]
        gone = raysched("status", "--address", head.address, home=home)
        assert "no raysched scheduler named 'raysched'" in one_line_error(gone, "status")


NEARLY_FULL_DISK = {"RAY_local_fs_capacity_threshold": "0.01"}  # the raylet's disk warning, at 1 % used
RAYLET_WARNS_EVERY_S = 10.0  # ... which it repeats this often (file_system_monitor)


@pytest.fixture(scope="module")
def one_worker_on_two_cpus(tmp_path_factory: pytest.TempPathFactory):
    """`ray start --head --num-cpus=2` and `raysched start` with one worker: the scheduler holds
    no CPU, the worker one, so the cluster has room for exactly one more worker. The head's
    raylet warns that its disk is nearly full, as it does on a machine whose disk is over 95 %
    full (a CI run once failed on that line in `scale`'s one-line error)."""
    home = tmp_path_factory.mktemp("scale") / "home"
    config = home.parent / "serve.yaml"
    home.mkdir()
    config.write_text(CONFIG)
    with RayHead(home, num_cpus=2, env=NEARLY_FULL_DISK) as head:
        started = raysched("start", "--config", config, "--address", head.address, home=home, timeout_s=240)
        assert started.returncode == 0, started.stderr[-3000:]
        yield head, home
        raysched("stop", "--address", head.address, home=home)


def test_scale_without_room_is_one_line_and_with_room_scales(one_worker_on_two_cpus) -> None:
    """No room for the asked workers: one line naming what a worker asks for and what the cluster
    has free, exit 2, no worker added (the subprocess timeout bounds the wait: once it hung for
    ever). Control: with room for one more, `scale` adds it. Then scaling down drains the newest
    worker and says where its requests went."""
    head, home = one_worker_on_two_cpus
    grown = raysched("scale", "--workers", 2, "--address", head.address, home=home, timeout_s=240)
    assert grown.returncode == 0 and "worker 1 added" in grown.stdout, grown.stderr[-3000:]
    full = raysched("scale", "--workers", 3, "--address", head.address, home=home, timeout_s=90)
    line = one_line_error(full, "scale")
    assert "no room for 1 more worker(s): a worker asks for 1 CPU; the cluster has 0 of 2 CPU free" in line, line
    status = raysched("status", "--address", head.address, home=home)
    assert status.returncode == 0 and re.findall(r"^worker (\d+):", status.stdout, re.M) == ["0", "1"], status.stdout
    shrunk = raysched("scale", "--workers", 1, "--address", head.address, home=home, timeout_s=120)
    assert shrunk.returncode == 0, shrunk.stderr[-3000:]
    assert re.search(r"worker 1 drained and removed: moved 0 request\(s\) in [\d.]+ s \(0 live, 0 by snapshot, "
                     r"0 requeued to prefill again\); 0 ended meanwhile; 0 waiting in the queue", shrunk.stdout), shrunk.stdout


@pytest.mark.slow  # ~15 s of waiting: under `slow` to keep the default suite near 15 min
def test_a_control_command_prints_no_cluster_daemon_line(one_worker_on_two_cpus) -> None:
    """`scale` waiting longer than the raylet's warning period: every stderr line is its own
    (progress, then the error), none is the raylet's disk warning. Control, side by side: a
    driver attached with Ray's default `log_to_driver` gets that warning in the same window."""
    head, home = one_worker_on_two_cpus
    wait_s = RAYLET_WARNS_EVERY_S + 5  # margin for the log monitor on a busy machine
    code = f"import ray, time\nray.init(address={head.address!r})\ntime.sleep({wait_s})\n"
    control = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=user_env(home), text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    waited = raysched("scale", "--workers", 3, "--timeout", wait_s, "--address", head.address, home=home,
                      timeout_s=120)
    _, control_err = control.communicate(timeout=120)
    assert "(raylet)" in control_err and "full" in control_err, control_err[-3000:]
    lines = [ln for ln in waited.stderr.splitlines() if ln.strip()]
    assert waited.returncode == 2 and all(ln.startswith("raysched scale: ") for ln in lines), waited.stderr[-3000:]
    assert "no room for 2 more worker(s)" in lines[-1] and f"after {wait_s:g} s" in lines[-1], lines[-1]


def _counters_named_in_the_docs(stats: dict) -> set[str]:
    """Every `name` in README.md and docs/*.md that is a counter of `raysched status --json`."""
    text = "".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    counters = {k for k, v in stats.items() if isinstance(v, (int, float, dict)) and k not in ("tables", "uptime_s")}
    return set(re.findall(r"`([a-z0-9_]+)`", text)) & counters


def _unshown(names: set[str], status_text: str) -> set[str]:
    return {n for n in names if not re.search(rf"(^|\s){n}\s", status_text, re.M)}


def test_status_prints_every_counter_the_docs_name(one_worker_on_two_cpus) -> None:
    """Control: without its `moves:` line the same check finds the migration counters missing
    (the issue's case: `status` printed `migrations` only)."""
    head, home = one_worker_on_two_cpus
    as_json = raysched("status", "--json", "--address", head.address, home=home)
    plain = raysched("status", "--address", head.address, home=home)
    assert as_json.returncode == 0 and plain.returncode == 0, as_json.stderr[-2000:] + plain.stderr[-2000:]
    named = _counters_named_in_the_docs(json.loads(as_json.stdout))
    assert {"live_migrations", "rebalance_moves", "migration_downtime_s", "state_cache_hits"} <= named, named
    assert _unshown(named, plain.stdout) == set(), plain.stdout
    without_moves = "\n".join(ln for ln in plain.stdout.splitlines() if not ln.startswith("moves:"))
    assert {"live_migrations", "rebalance_moves", "migration_downtime_s"} <= _unshown(named, without_moves)


@pytest.mark.parametrize("command", ["status", "stop", "start", "run", "serve"])
def test_unreachable_address_is_one_line_within_seconds(tmp_path: Path, command: str) -> None:
    """Nothing listens at the address: one line and exit 2 after the reachability check (5 s),
    not Ray's retries for ever."""
    address = f"127.0.0.1:{free_port()}"
    args = {"start": ["--config", REPO / "examples" / "serve.yaml"],
            "run": ["--config", REPO / "examples" / "serve.yaml", "--workload", REPO / "examples" / "workload.yaml"],
            "serve": ["--config", REPO / "examples" / "serve.yaml", "--port", free_port()]}.get(command, [])
    t0 = time.monotonic()
    proc = raysched(command, *args, "--address", address, home=tmp_path / "home", timeout_s=90)
    line = one_line_error(proc, command)
    assert f"no Ray cluster answers at {address}" in line
    assert time.monotonic() - t0 < 60


def test_connect_to_an_unreachable_address_raises_cluster_error(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    proc = python("import raysched\nfrom raysched.cluster import ClusterError\n"
                  f"try:\n    raysched.connect({address!r})\nexcept ClusterError as err:\n    print('refused:', err)\n",
                  tmp_path / "home", timeout_s=90)
    assert proc.returncode == 0 and f"refused: no Ray cluster answers at {address}" in proc.stdout, proc.stderr
