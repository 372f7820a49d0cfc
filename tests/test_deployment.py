"""One long-lived deployment: a named scheduler in namespace `raysched` that drivers share.

- A driver that `connect`s to a named scheduler gets the same tokens as the in-process
  reference; its `shutdown()` only disconnects (the scheduler keeps serving the launcher).
- A second scheduler under a taken name is refused (or, with `exist_ok`, the live one returned);
  an unknown name is a clear error.
- Unnamed launches still share one cluster side by side.
- `raysched start` (a separate driver process that exits) leaves a detached scheduler that
  `raysched status` describes and `raysched stop` ends together with its workers.
- A start whose caller cancels it (recursively, as Serve cancels the call of a handler whose
  client left) still brings the scheduler up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import ray

import raysched
from raysched import cli
from raysched.deployment import (NAMESPACE, SchedulerExistsError, SchedulerNotFoundError, find_scheduler,
                                 start_scheduler)
from raysched.sampling import SamplingParams
from raysched.tokenizer import load_tokenizer
from tests.conftest import NODE_OBJECT_STORE_BYTES, alive_actors, reference_tokens, wait_for_no_workers, wait_until

CONFIG = {"model": "tiny", "workers": 1, "pool": {"kv_tokens": 256, "state_slots": 4}}
PROMPTS = [[5, 17, 42, 7], [300, 2, 9]]
PARAMS = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=5, temperature=0.8, seed=3)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """An embedded local Ray instance for the module; yields its GCS address."""
    ray.init(address="local", num_cpus=3, include_dashboard=False,
             object_store_memory=NODE_OBJECT_STORE_BYTES, logging_level="WARNING")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return reference_tokens("tiny", PROMPTS, PARAMS)


def _tokens(client: raysched.Client) -> list[list[int]]:
    handles = [client.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    return [h.result(timeout=120)["token_ids"] for h in handles]


def _gone(name: str) -> bool:
    return find_scheduler(name) is None


def test_connected_client_shares_the_named_scheduler(cluster: str, reference: list[list[int]]) -> None:
    owner = raysched.launch(CONFIG, name="t-shared")
    try:
        driver = raysched.connect(name="t-shared")
        assert not driver.owns_scheduler and driver.workers == owner.workers
        assert driver.config == owner.config
        assert _tokens(driver) == reference
        tok = load_tokenizer("tiny")  # a text prompt: encoded by the client, stops at eos too
        text_ref = reference_tokens("tiny", [tok.encode("Hello world")],
                                    [SamplingParams(max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))])[0]
        record = driver.submit("Hello world", {"max_new_tokens": 6}).result(timeout=120)
        assert record["token_ids"] == text_ref and record["text"] == tok.decode(text_ref)
        driver.shutdown()  # disconnects only
        assert find_scheduler("t-shared") is not None
        assert _tokens(owner) == reference  # still serving
        assert owner.stats()["finished"] == 2 * len(PROMPTS) + 1
    finally:
        owner.shutdown()
    wait_until(lambda: _gone("t-shared"), 30, "the named scheduler to go away")
    wait_for_no_workers()


def test_a_taken_name_is_refused_and_exist_ok_returns_the_live_one(cluster: str) -> None:
    owner = raysched.launch(CONFIG, name="t-taken")
    try:
        with pytest.raises(SchedulerExistsError, match="t-taken"):
            start_scheduler(owner.config, name="t-taken")
        handle, workers = start_scheduler(owner.config, name="t-taken", exist_ok=True)
        assert handle._actor_id == owner.scheduler._actor_id and workers == owner.workers
        assert len(alive_actors("Worker")) == 1  # no second set of workers was started
    finally:
        owner.shutdown()
    wait_for_no_workers()


def test_unknown_name_is_a_clear_error(cluster: str) -> None:
    with pytest.raises(SchedulerNotFoundError, match="no raysched scheduler named 'nobody'"):
        raysched.connect(name="nobody")
    assert cli.main(["status", "--name", "nobody"]) == 2  # named error, exit code 2


def test_unnamed_launches_run_side_by_side(cluster: str, reference: list[list[int]]) -> None:
    a, b = raysched.launch(CONFIG), raysched.launch(CONFIG)
    try:
        assert a.scheduler._actor_id != b.scheduler._actor_id
        assert _tokens(a) == reference and _tokens(b) == reference
    finally:
        a.shutdown()
        b.shutdown()
    wait_for_no_workers()


def test_cli_start_status_stop_a_detached_scheduler(cluster: str, reference: list[list[int]], tmp_path,
                                                    capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("model: tiny\nworkers: 1\npool: {kv_tokens: 256, state_slots: 4}\n")
    start = [sys.executable, "-m", "raysched.cli", "start", "--config", str(config), "--address", cluster,
             "--name", "t-cli"]
    done = subprocess.run(start, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "scheduler 't-cli' started" in done.stdout
    # the starting driver has exited; the detached scheduler lives on
    assert ray.get_actor("t-cli", namespace=NAMESPACE) is not None
    client = raysched.connect(name="t-cli")
    assert _tokens(client) == reference
    client.shutdown()

    capsys.readouterr()
    assert cli.main(["status", "--name", "t-cli"]) == 0
    out = capsys.readouterr().out
    assert "worker 0:" in out and "kv free 256/256" in out and "state slots free 4/4" in out
    assert "finished 2" in out and "waiting 0" in out
    assert cli.main(["start", "--config", str(config), "--name", "t-cli"]) == 2  # name taken

    assert cli.main(["stop", "--name", "t-cli"]) == 0
    wait_until(lambda: _gone("t-cli"), 30, "the detached scheduler to go away")
    wait_for_no_workers()


def test_cli_scale_and_drain_a_detached_scheduler(cluster: str, tmp_path) -> None:
    """`raysched scale` / `drain` / `status` as a person runs them: subprocesses given the
    address, not RAY_ADDRESS (the other RAY_* variables stay: Ray's token authentication of
    this module's cluster travels in them)."""
    config = tmp_path / "serve.yaml"
    config.write_text("model: tiny\nworkers: 1\npool: {kv_tokens: 256, state_slots: 4}\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "raysched.cli", *args, "--address", cluster, "--name", "t-scale"],
                              capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stderr
        return done

    run("start", "--config", str(config))
    try:
        assert "worker 1 added" in run("scale", "--workers", "2").stdout
        assert "worker 1 drained: moved 0" in run("drain", "--worker", "1").stdout
        status = run("status").stdout
        assert "worker 0:" in status and "worker 1:" in status and status.count("(draining)") == 1
        assert "worker 1 drained" in run("scale", "--workers", "1").stdout
        assert "worker 1:" not in run("status").stdout
        bad = subprocess.run([sys.executable, "-m", "raysched.cli", "drain", "--worker", "7", "--address", cluster,
                              "--name", "t-scale"], capture_output=True, text=True, timeout=240, env=env)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "worker must be a live worker" in bad.stderr
    finally:
        run("stop")
    wait_until(lambda: _gone("t-scale"), 30, "the detached scheduler to go away")


def test_a_start_its_caller_cancelled_still_brings_the_scheduler_up(cluster: str, reference: list[list[int]]) -> None:
    """A restarted scheduler starts its workers on its first submit, which may be an HTTP
    handler's call; when that handler's client leaves, Serve cancels the call recursively. The
    start went on in a task made from that call, whose calls to the workers Ray then cancelled
    too: the start ended with TaskCancelledError and every later submit raised it. Here the
    creator's `start` call is cancelled once both worker actors exist (the start awaits them):
    a second `start` returns both workers, the requests get the reference tokens and no worker
    call failed. Control: the cancelled call itself raises TaskCancelledError (the cancel
    landed while it ran)."""
    from raysched.config import load_serve_config
    from raysched.deployment import scheduler_options
    from raysched.scheduler import Scheduler

    sched = ray.remote(Scheduler).options(**scheduler_options(None, False, 0)).remote(
        load_serve_config({**CONFIG, "workers": 2}))
    try:
        first = sched.start.remote()
        wait_until(lambda: len(alive_actors("Worker")) >= 2, 60, "both worker actors to exist")
        ray.cancel(first, recursive=True)
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(first, timeout=60)
        assert len(ray.get(sched.start.remote(), timeout=120)) == 2
        rids = [ray.get(sched.submit.remote(p, sp.to_dict())) for p, sp in zip(PROMPTS, PARAMS)]
        assert [ray.get(sched.wait.remote(r), timeout=120)["token_ids"] for r in rids] == reference
        assert ray.get(sched.stats.remote())["worker_failures"] == 0
    finally:
        ray.get(sched.shutdown.remote(), timeout=60)
        ray.kill(sched, no_restart=True)
    wait_for_no_workers()
