"""Every mistake and interrupt of a newcomer's first hour: one line and a nonzero exit, nothing left.

Each command runs as a user runs it (`tests.user_cli`: a subprocess, a fresh HOME, no RAY_*
variable). Checks that must come before Ray starts also assert that Ray never started: an
embedded Ray instance writes ~/.ray/auth_token into the fresh HOME. Interrupts run in a session
of their own, so the test can send a signal to the whole process group (as Ctrl-C in a
terminal and systemd do) and then see that no process of the session is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from raysched.cli import build_parser
from tests.conftest import wait_until
from tests.user_cli import (RAYSCHED, REPO, SERVE_YAML, WORKLOAD_YAML, free_port, one_line_error, raysched,
                            session_pids, user_env)

TINY = "model: tiny\nworkers: 1\npool: {kv_tokens: 256, state_slots: 4}\n"


def _ray_never_started(home: Path) -> bool:
    return not (home / ".ray").exists()


def test_generate_with_a_pool_too_small_is_one_line(tmp_path: Path) -> None:
    proc = raysched("generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--kv-tokens", "2",
                    home=tmp_path / "home")
    assert one_line_error(proc, "generate") == ("raysched generate: error: --kv-tokens 2 is too small: prompt 0 "
                                                "(3 tokens) + --max-new-tokens (8) needs 10 KV tokens")


def test_stop_escapes_are_unescaped() -> None:
    """`--stop "\\n"` (a backslash and an n from the shell) is a newline, as the README says."""
    args = build_parser().parse_args(["generate", "--prompt", "Hi", "--stop", "\\n", "--stop", "a\\tb",
                                      "--stop", "\\\\n", "--stop", "\\x"])
    assert args.stop == ["\n", "a\tb", "\\n", "\\x"]


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_model_that_is_no_checkpoint_is_one_line_before_ray_starts(tmp_path: Path, case: str) -> None:
    home, model = tmp_path / "home", tmp_path / "ckpt"
    if case == "empty":
        model.mkdir()
    config = tmp_path / "serve.yaml"
    config.write_text(TINY.replace("model: tiny", f"model: {model}"))
    for command, extra in (("run", ["--workload", WORKLOAD_YAML]), ("serve", ["--port", free_port()])):
        line = one_line_error(raysched(command, "--config", config, *extra, home=home), command)
        assert f"model '{model}' is" in line
        want = "neither a preset" if case == "missing" else "a directory without config.json"
        assert want in line
    assert _ray_never_started(home)


def test_bad_trace_is_one_line_before_ray_starts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_ids": [1, 2], "max_new_tokens": 4}\n{"prompt_ids": [3], "max_new_tokens": 4\n')
    workload = tmp_path / "workload.yaml"
    workload.write_text(f"trace: {trace}\n")
    line = one_line_error(raysched("run", "--config", SERVE_YAML, "--workload", workload, home=home), "run")
    assert f"workload: {trace}:2: malformed JSON" in line
    assert _ray_never_started(home)


def test_serve_on_a_taken_port_is_one_line_before_ray_starts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = raysched("serve", "--config", SERVE_YAML, "--port", port, home=home)
    line = one_line_error(proc, "serve")
    assert line.startswith(f"raysched serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert _ray_never_started(home)


class Spawned:
    """A raysched command in a session of its own; its stderr is collected as it comes."""

    def __init__(self, args: list[object], home: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([*RAYSCHED, *map(str, args)], cwd=REPO, env={**user_env(home), **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.err = self.out = ""
        self._readers = [threading.Thread(target=self._read, args=(name,), daemon=True) for name in ("err", "out")]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        stream = self.proc.stderr if name == "err" else self.proc.stdout
        while chunk := os.read(stream.fileno(), 4096):
            setattr(self, name, getattr(self, name) + chunk.decode(errors="replace"))

    def signal(self, sig: int, group: bool) -> float:
        (os.killpg if group else os.kill)(self.proc.pid, sig)
        return time.monotonic()

    def finish(self, timeout_s: float = 120) -> str:
        """Wait for the exit; fail unless every process of its session is gone soon after."""
        self.proc.wait(timeout=timeout_s)  # a command that ignores the signal fails here, not hangs
        for reader in self._readers:
            reader.join(timeout=10)
        wait_until(lambda: not session_pids(self.proc.pid), 30, "every process of the command's session to exit")
        return self.out

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def late_workload(tmp_path: Path) -> Path:
    """24 requests: 4 arrive at once, 20 an hour later, so the run is surely still going when
    the signal comes (the demo workload can finish between two looks on a quick machine)."""
    trace = tmp_path / "late.jsonl"
    trace.write_text("".join(json.dumps({"prompt_ids": [1 + (i * 7 + j) % 50 for j in range(12)],
                                         "max_new_tokens": 16, "arrival_s": 0 if i < 4 else 3600}) + "\n"
                             for i in range(24)))
    workload = tmp_path / "late.yaml"
    workload.write_text(f"trace: {trace}\n")
    return workload


@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow)],
                         ids=["ctrl-c-to-the-group", "sigterm-to-the-pid"])
def test_interrupted_run_writes_the_summary_and_report_of_what_finished(tmp_path: Path, sig: int,
                                                                         group: bool) -> None:
    report = tmp_path / "out.json"
    run = Spawned(["run", "--config", SERVE_YAML, "--workload", late_workload(tmp_path), "--report", report],
                  tmp_path / "home")
    try:
        wait_until(lambda: re.search(r"done [1-9]", run.err) or run.proc.poll() is not None, 300,
                   "the first finished request")
        assert run.proc.poll() is None, run.err[-3000:]
        sent = run.signal(sig, group)
        out = run.finish()
    finally:
        run.kill()
    assert run.proc.returncode == 128 + sig, run.err[-3000:]
    assert "Traceback" not in run.err and run.err.rstrip().endswith(
        f"raysched run: interrupted ({signal.Signals(sig).name})"), run.err[-3000:]
    assert "interrupted" in out and "summary" in out
    written = json.loads(report.read_text())
    assert written["summary"]["interrupted"] is True and written["summary"]["finished"] >= 1
    assert written["summary"]["finished"] + written["summary"]["unfinished"] == 24
    assert time.monotonic() - sent < 60  # measured: 3-4 s (pid), 9-26 s (group) on a loaded 2-core box


@pytest.mark.parametrize("command, sig, group", [("serve", signal.SIGINT, True), ("run", signal.SIGTERM, False),
                                                 ("run", signal.SIGINT, True)],
                         ids=["ctrl-c-to-serves-group", "sigterm-to-runs-pid", "ctrl-c-to-runs-group"])
@pytest.mark.parametrize("delay_s", [0.0, pytest.param(1.0, marks=pytest.mark.slow)],
                         ids=["ray-starting", "ray-connecting"])
def test_a_signal_while_ray_starts_is_one_line(tmp_path: Path, command: str, sig: int, group: bool,
                                               delay_s: float) -> None:
    """Ray's start-up is not cut in the middle (a KeyboardInterrupt there once crashed the process
    at exit, and Ray's own SIGTERM handlers exit quietly or abort): the signal waits for it, then
    everything stops, in one line. Once, the SIGINT was lost and the server came up. `run` still
    prints its summary and writes its `--report`, with no request finished (the control, a later
    interrupt that lists what finished: `test_interrupted_run_writes_the_summary_and_report_...`)."""
    home = tmp_path / "home"
    config = tmp_path / "serve.yaml"
    config.write_text(TINY)
    report = tmp_path / "out.json"
    args = (["--port", free_port()] if command == "serve" else
            ["--workload", late_workload(tmp_path), "--report", report])
    spawned = Spawned([command, "--config", config, *args], home)
    try:
        wait_until(lambda: (home / ".ray").exists() or spawned.proc.poll() is not None, 120,
                   "Ray to begin starting")  # its first seconds: the embedded instance is starting
        time.sleep(delay_s)
        spawned.signal(sig, group)
        spawned.finish()
    finally:
        spawned.kill()
    name = signal.Signals(sig).name
    started = "raysched serve: http" if command == "serve" else "worker 0: node"
    assert started not in spawned.out, "the signal came after the start-up: this case tests nothing"
    assert spawned.proc.returncode == 128 + sig, spawned.err[-3000:]
    assert "Traceback" not in spawned.err and spawned.err.rstrip().endswith(f"raysched {command}: interrupted ({name})")
    if command == "run":
        summary = json.loads(report.read_text())["summary"]
        assert (summary["interrupted"], summary["finished"], summary["unfinished"]) == (True, 0, 24), summary
        assert "summary" in spawned.out and "24 requests did not finish" in spawned.out, spawned.out[-2000:]


@pytest.mark.slow  # two embedded clusters, ~11 s: under `slow` to keep the default suite near 15 min
def test_ray_shutdown_leaves_our_sigterm_handler_in_place(tmp_path: Path) -> None:
    """`ray.shutdown` sets SIGTERM to its default action at the C level (Python's `getsignal`
    does not show it): a SIGTERM then ends the process with no clean-up. `shutdown_ray` puts
    the command's handler back. Negative control: after a plain `ray.shutdown`, the process is
    killed by the SIGTERM it sends itself."""
    script = (
        "import os, signal, sys, time, ray\n"
        "from raysched import interrupts\n"
        "from raysched.cluster import shutdown_ray, start_embedded\n"
        "interrupts.install()\n"
        "start_embedded(1, 80 << 20)\n"
        "shutdown_ray() if sys.argv[1] == 'ours' else ray.shutdown()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(10)\n"
        "except interrupts.Interrupted as err:\n"
        "    print('interrupted', err.signum)\n")
    runs = {which: subprocess.run([sys.executable, "-c", script, which], cwd=REPO, env=user_env(tmp_path / which),
                                  capture_output=True, text=True, timeout=240) for which in ("ours", "ray")}
    assert runs["ours"].returncode == 0 and runs["ours"].stdout.strip() == "interrupted 15", runs["ours"].stderr[-2000:]
    assert runs["ray"].returncode == -signal.SIGTERM, runs["ray"].stderr[-2000:]


def test_sigterm_to_serves_process_group_exits_promptly(tmp_path: Path) -> None:
    """What systemd's KillMode=control-group does: Ray's own processes get the SIGTERM too.
    Measured on a loaded 2-core box: 11 s (before: 62 s, with GCS errors). Before the signal,
    the server answers a completion with its API key and refuses one without (401).
    (`test_serve.py::test_raysched_serve_exits_cleanly_on_sigterm`, the signal to the CLI's
    process alone, is under `slow`.)"""
    config = tmp_path / "serve.yaml"
    config.write_text(TINY)
    port = free_port()
    key = "test-key-sigterm"
    server = Spawned(["serve", "--config", config, "--port", port], tmp_path / "home", {"RAYSCHED_API_KEY": key})
    try:
        def up() -> bool:  # the banner: what tells a user (or a test) that start-up is over
            try:
                return "raysched serve: http" in server.out and httpx.get(
                    f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return server.proc.poll() is not None
        wait_until(up, 300, "raysched serve to print its banner and answer /health")
        assert server.proc.poll() is None, server.err[-3000:]
        url = f"http://127.0.0.1:{port}/v1/completions"
        answered = httpx.post(url, json={"prompt": "Hi", "max_tokens": 3},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] >= 1, answered.text
        assert httpx.post(url, json={"prompt": "Hi"}, timeout=60).status_code == 401
        sent = server.signal(signal.SIGTERM, group=True)
        out = server.finish()
        took = time.monotonic() - sent
    finally:
        server.kill()
    assert server.proc.returncode == 0, server.err[-3000:]
    assert "raysched serve: shutting down" in out and "Traceback" not in server.err
    assert "graceful_shutdown failed" not in server.err
    assert took < 45, f"{took:.0f} s to exit"
