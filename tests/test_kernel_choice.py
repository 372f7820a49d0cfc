"""`actors.kernel_choice`: one measured kernel per weight shape and phase, kept per machine.

Held here: the rule (the default unless another candidate is faster by the margin; ties to
the earlier candidate); a choice is measured once per machine and read back by every later
process (the file is the table: an entry planted in it is obeyed, the negative control that
shows the processes read it rather than measure again); processes starting together on an
empty cache agree; a damaged file is measured again, not fatal; a forced kernel is checked
against the candidates in one line; and on every candidate this CPU can pick, a request
snapshotted mid-decode resumes on another engine bit-exactly (reference: the uninterrupted
run on that candidate). The negative control there: a snapshot taken on one candidate and
resumed on another does not continue bit-exactly (why the scheduler warns on mixed choices).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from actors import kernel_choice, rowdot
from actors.engine import Sequence
from actors.kernel_choice import ENV_FORCE, MARGIN, candidates, decide
from tests.test_snapshot_resume import GREEDY, engine, run_to_end, sequences, uninterrupted

KERNELS = candidates()
SHAPES = ((96, 64), (40, 72))  # (out, in): small, so a fresh measurement takes little time
CHOOSE = ("import json, torch; torch.set_num_threads(1); from actors import kernel_choice as kc;"
          "got = {f'{p} {o}x{i}': kc.choose((o, i), p) for o, i in %r for p in kc.PHASES};"
          "print(json.dumps({'got': got, 'measured': kc.measure_seconds() > 0}))" % (SHAPES,))


def _choose_in_subprocess(cache, extra_env: dict | None = None) -> subprocess.Popen:
    _with_builds(cache)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY", "CC"))}
    return subprocess.Popen([sys.executable, "-c", CHOOSE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**env, "RAYSCHED_KERNEL_CACHE": str(cache), **(extra_env or {})})


def _with_builds(cache) -> None:
    """Copy this machine's compiled rowdot builds into the fresh cache: these tests are about
    the choice file, and compiling every build again took ~6 s of each (tests/test_rowdot.py
    covers the compile into an empty cache)."""
    for build in rowdot.builds_here():
        built, _ = rowdot.compile_only(build)
        if built is not None and not (cache / built.name).exists():
            shutil.copy(built, cache / built.name)


def _answer(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _file(cache) -> tuple[object, dict]:
    path = next(cache.glob("kernel-choice-*.json"))
    return path, json.loads(path.read_text())


def test_the_rule_keeps_the_default_unless_another_is_faster_by_the_margin():
    names = ("rowdot a", "rowdot b", "mkl packed")
    assert decide({"rowdot a": 1.0, "rowdot b": 1.0 - MARGIN / 2, "mkl packed": 1.1}, names) == "rowdot a"
    assert decide({"rowdot a": 1.0, "rowdot b": 0.95, "mkl packed": 0.8}, names) == "mkl packed"
    assert decide({"rowdot a": 1.0, "rowdot b": 0.8, "mkl packed": 0.8}, names) == "rowdot b"  # a tie
    assert decide({"rowdot a": 1.0, "rowdot b": 0.5}, names) == "rowdot b"  # MKL not row-free: absent
    assert decide({"rowdot a": 1.0}, names[:1]) == "rowdot a"


def test_a_near_tie_between_two_others_goes_to_the_earlier_whichever_measured_lower():
    """Two candidates that both beat the default, within the margin of each other: the earlier
    one, in either order of their timings (so identical machines agree despite noise). The
    control: a later one faster than the earlier by more than the margin is taken."""
    names = ("rowdot a", "rowdot panel", "mkl packed")
    for panel, mkl in ((0.80, 0.79), (0.79, 0.80)):
        assert decide({"rowdot a": 1.0, "rowdot panel": panel, "mkl packed": mkl}, names) == "rowdot panel"
    assert decide({"rowdot a": 1.0, "rowdot panel": 0.80, "mkl packed": 0.77}, names) == "mkl packed"


def test_a_choice_is_measured_once_per_machine_and_read_back(tmp_path):
    first = _answer(_choose_in_subprocess(tmp_path))
    second = _answer(_choose_in_subprocess(tmp_path))
    assert set(first["got"].values()) <= set(KERNELS)
    assert second["got"] == first["got"]
    assert second["measured"] is False and first["measured"] is (len(KERNELS) > 1)
    _, data = _file(tmp_path)
    assert {e["kernel"] for k, e in data["entries"].items() if k.startswith("choice")} <= set(KERNELS)


def test_negative_control_an_entry_planted_in_the_file_is_obeyed(tmp_path):
    """The later processes read the file rather than measure: each shape takes the kernel
    planted for it, whatever timings would say (the default for one, the last candidate for
    the other, in both phases)."""
    if len(KERNELS) < 2:
        pytest.skip(f"one candidate on this CPU ({KERNELS}): nothing to choose between")
    _answer(_choose_in_subprocess(tmp_path))
    path, data = _file(tmp_path)
    planted = {}
    for (o, i), kernel in zip(SHAPES, (KERNELS[0], KERNELS[-1])):
        for phase in kernel_choice.PHASES:
            data["entries"][f"choice {phase} {o}x{i}"] = {"kernel": kernel}
            planted[f"{phase} {o}x{i}"] = kernel
    path.write_text(json.dumps(data))
    answer = _answer(_choose_in_subprocess(tmp_path))
    assert answer == {"got": planted, "measured": False}


@pytest.mark.slow
def test_processes_starting_together_on_an_empty_cache_agree(tmp_path):
    procs = [_choose_in_subprocess(tmp_path) for _ in range(2)]
    a, b = (_answer(p) for p in procs)
    assert a["got"] == b["got"]
    assert not list(tmp_path.glob("*.tmp"))  # every write was renamed into place


def test_a_damaged_file_is_measured_again_not_fatal(tmp_path):
    _answer(_choose_in_subprocess(tmp_path))
    path, _ = _file(tmp_path)
    path.write_text("{ not json")
    answer = _answer(_choose_in_subprocess(tmp_path))
    assert set(answer["got"].values()) <= set(KERNELS)
    assert json.loads(path.read_text())["entries"]


def test_a_forced_kernel_is_taken_and_a_wrong_one_named_in_one_line(monkeypatch):
    monkeypatch.setenv(ENV_FORCE, KERNELS[-1])
    assert kernel_choice.choose((96, 64), "decode") == KERNELS[-1]
    monkeypatch.setenv(ENV_FORCE, "rowdot avx9000")
    with pytest.raises(ValueError, match=r"RAYSCHED_KERNEL='rowdot avx9000' does not run here: one of") as e:
        kernel_choice.choose((96, 64), "decode")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="phase must be one of"):
        kernel_choice.choose((96, 64), "train")


def _resumed_on_another_engine(snapshot_kernel: str, resume_kernel: str, monkeypatch):
    """Request r3 prefilled and decoded 5 steps on an engine under `snapshot_kernel`, then
    resumed on another engine (another pool layout) under `resume_kernel`: its logits."""
    monkeypatch.setenv(ENV_FORCE, snapshot_kernel)
    a = engine()
    a.prefill(sequences(GREEDY))
    a.decode(5)
    snap = a.snapshot("r3")
    monkeypatch.setenv(ENV_FORCE, resume_kernel)
    b = engine(kv_tokens=300, state_slots=3, page_size=4)
    b.prefill([Sequence("other", [9] * 50, 50, GREEDY)])
    assert b.restore(snap)
    run_to_end(b)
    return b.logits["r3"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_candidate_resumes_on_another_engine_bit_exactly(kernel, monkeypatch):
    monkeypatch.setenv(ENV_FORCE, kernel)
    ref = uninterrupted(GREEDY).logits["r3"]
    got = _resumed_on_another_engine(kernel, kernel, monkeypatch)
    assert len(got) == len(ref) - 6 and all(torch.equal(x, y) for x, y in zip(got, ref[6:]))


def test_negative_control_a_snapshot_resumed_on_another_candidate_is_not_bit_exact(monkeypatch):
    if len(KERNELS) < 2:
        pytest.skip(f"one candidate on this CPU ({KERNELS}): nothing to mix")
    monkeypatch.setenv(ENV_FORCE, KERNELS[0])
    ref = uninterrupted(GREEDY).logits["r3"]
    got = _resumed_on_another_engine(KERNELS[0], KERNELS[-1], monkeypatch)
    assert not all(torch.equal(x, y) for x, y in zip(got, ref[6:]))


def test_worker_info_names_the_choice_and_two_choices_read_differently(monkeypatch):
    """`matrix_kernel` (what a worker reports as `WorkerInfo.kernel`) carries the choice per
    phase; workers on other choices report other strings (so the scheduler's mixed-kernel
    warning fires), and a model forced onto one kernel says so."""
    from actors.model import matrix_kernel
    from actors.presets import load_preset

    model, _ = load_preset("tiny", torch.float32, "cpu")
    reported = []
    for kernel in KERNELS:
        monkeypatch.setenv(ENV_FORCE, kernel)
        reported.append(matrix_kernel(model))
        assert reported[-1].startswith(f"decode {kernel}, prefill {kernel}; mkl "), reported[-1]
    assert len(set(reported)) == len(KERNELS)
    monkeypatch.delenv(ENV_FORCE)
    model.linear_kernel = KERNELS[-1]
    assert matrix_kernel(model).startswith(f"all {KERNELS[-1]}; mkl ")
