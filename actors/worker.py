"""The worker actor: one per GPU (or CPU), owning one engine and its hybrid pool.

It follows step plans from the scheduler and never decides anything itself. Snapshots it takes
are the *return values* of `retract`, so the caller (the scheduler) owns them in the object store.

    worker = ray.remote(num_gpus=1)(Worker).remote(config, index=0)
    info = ray.get(worker.info.remote())
"""

from __future__ import annotations

import time

import ray
import torch

from actors.engine import Engine, Sequence, StepOutput, build_engine
from actors.snapshot import Snapshot, SnapshotError
from raysched.config import ServeConfig
from raysched.messages import PrefillItem, StepPlan, StepResult, Usage, WorkerInfo
from raysched.sampling import SamplingParams


class Worker:
    def __init__(self, config: ServeConfig, index: int) -> None:
        self.index = index
        self.config = config
        self.engine: Engine = build_engine(config.model, config.dtype, config.device,
                                           pool_config=config.pool, invariant_tile=config.invariant_tile,
                                           seed=config.seed)
        self.drop_mamba_state = config.scheduler.debug_drop_mamba_state
        self._speeds: tuple[float, float] | None = None

    # ------------------------------------------------------------------ queries
    def info(self) -> WorkerInfo:
        e = self.engine
        itemsize = e.pool.k.element_size()
        copy_bps, prefill_tps = self._measure_speeds() if self.config.scheduler.retract == "auto" else (0.0, 0.0)
        return WorkerInfo(self.index, _node_id(), str(e.device), e.fingerprint, e.config.vocab_size,
                          e.config.max_position_embeddings, self.usage(),
                          e.config.kv_bytes_per_token(itemsize), e.config.mamba_bytes_per_slot(itemsize),
                          copy_bps, prefill_tps)

    def usage(self) -> Usage:
        u = self.engine.usage()
        return Usage(u.kv_free_tokens, u.kv_total_tokens, u.mamba_free_slots, u.mamba_total_slots,
                     u.page_size)

    def running_ids(self) -> list[str]:
        """Requests holding slots here: decoding and prefilling."""
        return sorted([*self.engine.running, *self.engine.prefilling])

    def is_idle(self) -> bool:
        """True when no request is running and every slot is back in the free lists."""
        return not self.running_ids() and self.engine.pool.is_empty()

    # ------------------------------------------------------------------ commands
    def retract(self, request_id: str) -> Snapshot:
        """Snapshot the request and free its slots; the snapshot is this call's return value.

        A request still prefilling has no snapshot to give: its slots are freed and the call
        raises SnapshotError, so the scheduler resumes it by recompute.
        """
        if request_id in self.engine.prefilling:
            seq = self.engine.release(request_id)
            raise SnapshotError(f"request {request_id!r} was retracted mid-prefill ({seq.num_computed}"
                                f" of {len(seq.token_ids)} tokens): released, recompute it")
        return self.engine.snapshot(request_id)

    def step(self, plan: StepPlan, *snapshots: Snapshot) -> StepResult:
        """Execute one plan: drop, resume, prefill, then `decode_steps` decode steps."""
        t0 = time.perf_counter()
        result = StepResult()
        for rid in plan.drop:
            if rid in self.engine.running or rid in self.engine.prefilling:
                self.engine.release(rid)
        out = StepOutput()
        self._resume(plan.resume, snapshots, result, out)
        todo = [*self.engine.prefilling, *map(_sequence, plan.prefill)]  # continued ones first
        if todo:
            out.merge(self.engine.prefill(todo, plan.prefill_chunk_tokens or None))
        if plan.decode_steps:
            out.merge(self.engine.decode(plan.decode_steps))
        return self._result(result, out, time.perf_counter() - t0)

    def _resume(self, ids: tuple[str, ...], snapshots: tuple, result: StepResult, out: StepOutput) -> None:
        if len(ids) != len(snapshots):
            raise ValueError(f"step plan names {len(ids)} resumes but {len(snapshots)} snapshots came")
        for rid, snap in zip(ids, snapshots):
            try:
                ok = self.engine.restore(snap, rid)
            except SnapshotError as err:
                result.resume_failed[rid] = str(err)
                continue
            if not ok:
                out.not_admitted.append(rid)
            elif self.drop_mamba_state:  # deliberately broken mode: the negative control
                self.engine.pool.mamba.zero(self.engine.pool.mamba.slot(rid))

    def _result(self, result: StepResult, out: StepOutput, busy_s: float) -> StepResult:
        result.new_tokens, result.finished = out.new_tokens, out.finished
        result.stalled, result.not_admitted = out.stalled, out.not_admitted
        result.allocated = {rid: self.engine.pool.kv.num_request_tokens(rid) for rid in self.running_ids()}
        result.usage = self.usage()
        result.busy_s = busy_s
        return result

    # ------------------------------------------------------------------ cost model inputs
    def _measure_speeds(self) -> tuple[float, float]:
        """(bytes/s of a plain copy, prefill tokens/s) on this device, measured once."""
        if self._speeds is None:
            self._speeds = (_copy_speed(self.engine.device), _prefill_speed(self.engine))
        return self._speeds


def _sequence(item: PrefillItem) -> Sequence:
    return Sequence(item.request_id, list(item.token_ids), item.prompt_len,
                    SamplingParams.from_dict(item.sampling))


def _node_id() -> str:
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # not inside Ray (direct use, tests)
        return "local"


def _copy_speed(device: torch.device, nbytes: int = 32 << 20) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - t0)


def _prefill_speed(engine: Engine, num_tokens: int = 256) -> float:
    if not engine.can_prefill(num_tokens):
        num_tokens = max(2, engine.usage().kv_free_tokens // 2)
    seq = Sequence("__speed__", [1] * num_tokens, num_tokens, SamplingParams(max_new_tokens=2))
    t0 = time.perf_counter()
    engine.prefill([seq])
    elapsed = time.perf_counter() - t0
    if "__speed__" in engine.running:
        engine.release("__speed__")
    return num_tokens / elapsed
