"""The driver API: start (or attach to) Ray, start the scheduler, submit requests.

    import raysched
    client = raysched.launch("examples/serve.yaml")        # embedded local Ray by default
    handle = client.submit([5, 17, 42], {"max_new_tokens": 8})
    print(handle.result()["token_ids"])
    client.shutdown()
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ray

from raysched import interrupts
from raysched.cluster import attach, init_ray, shutdown_ray
from raysched.config import ServeConfig, check_model_source, load_serve_config
from raysched.deployment import DEFAULT_MAX_RESTARTS
from raysched.sampling import RequestError, RequestIdInUseError, SamplingParams, UnknownRequestError
from raysched.tokenizer import TextTokenizer, load_tokenizer, output_text, require_tokenizer, with_eos_stop

RESTART_WAIT_S = 300.0  # how long a call waits for Ray to restart a dead scheduler
RESTART_POLL_S = 0.2
SINK_WAIT_S = 2.0  # a stream's read of its sink waits this long before it looks for the scheduler
STATUS_WAIT_S = 2.0  # ... and that look waits this long for an answer (a busy scheduler: read on)


class SchedulerDiedError(RuntimeError):
    """The scheduler actor is gone; pending requests cannot complete through it."""


class SchedulerRestartingError(SchedulerDiedError):
    """The scheduler died and Ray is restarting it (`max_restarts`): ask again shortly."""


class ClientClosedError(RuntimeError):
    """This `Client` was shut down; it cannot be used again (launch or connect a new one)."""


def _get(ref: Any, timeout: float | None = None) -> Any:
    """ray.get, turning the scheduler's death into a SchedulerDiedError and a rejected request
    into the plain RequestError the scheduler raised (its message, without Ray's traceback)."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.ActorUnavailableError as err:
        raise SchedulerRestartingError(f"the raysched scheduler actor is unavailable: {err}") from None
    except ray.exceptions.RayActorError as err:
        raise SchedulerDiedError(f"the raysched scheduler actor died: {err}") from None
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, RequestError):
            raise err.cause from None
        raise


def launch(config: ServeConfig | str | Mapping[str, Any] | None = None, address: str | None = None,
           num_cpus: int | None = None, name: str | None = None, detached: bool = False,
           max_restarts: int = DEFAULT_MAX_RESTARTS) -> "Client":
    """Start the scheduler and its workers; returns a `Client` that owns them.

    With `address` (or RAY_ADDRESS) it attaches to that cluster; otherwise it starts an embedded
    local Ray instance (no dashboard, bounded object store) that `Client.shutdown` stops again.
    If Ray is already initialised in this process, that instance is used as is. By default the
    scheduler is unnamed (several launches may share a cluster); with `name` it is registered in
    namespace `raysched` so that `raysched.connect(name=...)` finds it (see `raysched.deployment`).
    If the scheduler's process dies, Ray restarts it up to `max_restarts` times and request
    handles resubmit their requests to it (see `RequestHandle`).
    """
    from raysched.deployment import start_scheduler

    cfg = config if isinstance(config, ServeConfig) else load_serve_config(config or {})
    owns_ray = _init_ray(cfg, address, num_cpus)
    try:
        interrupts.raise_if_signalled()  # a Ctrl-C held back while Ray started (the CLI's `holding`)
        sched, workers = start_scheduler(cfg, name, detached, max_restarts)
    except BaseException:
        if owns_ray:
            shutdown_ray()
        raise
    return Client(sched, cfg, workers, owns_ray, owns_scheduler=True)


def connect(address: str | None = None, name: str | None = None, log_to_driver: bool = True) -> "Client":
    """Attach to a running named scheduler (one long-lived deployment); returns a `Client`.

    `address` defaults to RAY_ADDRESS, else the newest cluster on this machine ("auto"); if Ray
    is already initialised in this process that connection is used. `log_to_driver=False`
    keeps the cluster daemons' lines off this process's stderr (`raysched.cluster`; the CLI's
    commands). `shutdown()` on the client only disconnects; `stop()` ends the scheduler and its
    workers.

    >>> client = raysched.connect("127.0.0.1:6379")      # the scheduler `raysched serve` started
    """
    from raysched.deployment import DEFAULT_NAME, SchedulerNotFoundError, find_scheduler

    name = name or DEFAULT_NAME
    owns_ray = False
    if not ray.is_initialized():
        attach(address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver)
        owns_ray = True
    handle = find_scheduler(name)
    if handle is None:
        if owns_ray:
            shutdown_ray()
        raise SchedulerNotFoundError(f"no raysched scheduler named {name!r} runs in this cluster "
                                     f"(start one with `raysched start` or `raysched serve`)")
    try:
        info = _get(handle.describe.remote())
    except BaseException:
        if owns_ray:
            shutdown_ray()
        raise
    return Client(handle, info["config"], info["workers"], owns_ray, owns_scheduler=False)


def _init_ray(cfg: ServeConfig, address: str | None, num_cpus: int | None) -> bool:
    """Connect to Ray for `launch` and `raysched serve` (see `raysched.cluster.init_ray`), once
    the model is known to exist here when the workers will run here (no address)."""
    check_model_source(cfg.model, local=not (address or os.environ.get("RAY_ADDRESS")))
    return init_ray(address, num_cpus or max(2, cfg.workers + 1), cfg.object_store_memory)


class Client:
    """A driver's view of one scheduler: submit requests, read stats, end it.

    `owns_scheduler`: made by `launch` (shutdown ends the scheduler) or by `connect` (shutdown
    only disconnects; the shared scheduler keeps serving others)."""

    def __init__(self, scheduler: Any, config: ServeConfig, workers: list[dict], owns_ray: bool,
                 owns_scheduler: bool = True) -> None:
        self.scheduler = scheduler
        self.config = config
        self.workers = workers  # one dict per worker: node, device, pool sizes
        self._owns_ray = owns_ray
        self.owns_scheduler = owns_scheduler
        self._closed = False
        self.direct_tokens = True  # streams read tokens from this client's sink, sent there by the
        #   workers (`raysched.sink`); False: through the scheduler (`next_tokens`), the old path
        from raysched.sink import new_sink

        # started now (where Ray runs), so that a first reader finds it running
        self._sink: Any = new_sink(wait=False) if ray.is_initialized() else None
        self._sink_ready = False
        self._reader: Any = None  # `raysched.sink.SinkReader` of `_sink`, made on the first read
        self._reader_lock = threading.Lock()

    @property
    def sink(self) -> Any:
        """This client's `raysched.sink.TokenSink` actor (owned here; waited for on first use)."""
        if self._sink is None:
            from raysched.sink import new_sink

            self._sink = new_sink(wait=False)
        if not self._sink_ready:
            ray.get(self._sink.__ray_ready__.remote())
            self._sink_ready = True
        return self._sink

    def read_sink(self, sink: Any, rid: str, cursor: int, wait_s: float) -> tuple[list[int], bool, str | None]:
        """`TokenSink.next` of `sink`: this client's own is read by its `SinkReader` (one call
        for all of its streams), another one directly."""
        if sink is not self._sink:
            return ray.get(sink.next.remote(rid, cursor, wait_s))
        with self._reader_lock:  # streams read from many threads
            if self._reader is None:
                from raysched.sink import SinkReader

                self._reader = SinkReader(sink)
        return self._reader.next(rid, cursor, wait_s)

    def forget_stream(self, sink: Any, rid: str) -> None:
        """The stream of `rid` was read to its end."""
        if sink is self._sink and self._reader is not None:
            self._reader.forget(rid)
        else:
            sink.forget.remote(rid)

    @property
    def scheduler(self) -> Any:
        """The scheduler actor's handle; a closed client raises `ClientClosedError` at once (its
        Ray connection may be gone: a call would re-initialise Ray and hang on a stale cluster)."""
        if self._closed:
            raise ClientClosedError("this raysched Client was shut down; launch() or connect() a new one")
        return self._scheduler

    @scheduler.setter
    def scheduler(self, handle: Any) -> None:
        self._scheduler = handle

    def submit(self, prompt: str | Sequence[int], sampling: SamplingParams | Mapping[str, Any] | None = None,
               request_id: str | None = None, priority: int = 0, stream: bool = False,
               shared_prefix: int = 0) -> "RequestHandle":
        """Queue a request: a text prompt (encoded with the model's tokenizer; it also stops at the
        eos token) or token ids. Invalid input raises `RequestError` here, before anything is allocated.
        `priority`: lower is more urgent (default 0); a more urgent request that finds no room
        preempts the least urgent running ones (see `scheduler.preemption`). `stream`: you will
        read it with `handle.stream()`, so each decode step's tokens come as the step completes
        from its first worker call on (without it, from the first `stream()` read on).
        `shared_prefix`: how many prompt tokens other prompts share (a system prompt): with
        prefix reuse this request parks a state there, so the next one sharing it hits even when
        it comes after this one ended (the HTTP chat endpoint sets it to the system message).

        >>> h = client.submit([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.7, "seed": 1})
        >>> h = client.submit("Once upon a time", {"max_new_tokens": 16, "stop": ["\n"]})
        >>> urgent = client.submit([4, 5], {"max_new_tokens": 4}, priority=-1)
        """
        params = sampling.to_dict() if isinstance(sampling, SamplingParams) else dict(sampling or {})
        prompt_ids = list(prompt)
        if isinstance(prompt, str):  # text in: stop at the tokenizer's eos token too
            prompt_ids, params = self.encode(prompt), with_eos_stop(params, self.tokenizer)
        sink = self.sink if stream and self.direct_tokens else None
        if sink is not None and self._reader is not None and request_id is not None:
            self._reader.drop(request_id)  # an id used again is read afresh
        rid = self._call("submit", prompt_ids, params, request_id, priority, stream, sink, shared_prefix)
        return RequestHandle(self, rid, prompt_ids, params, priority=priority, sink=sink)

    @property
    def tokenizer(self) -> TextTokenizer | None:
        """The model's tokenizer (None for a checkpoint without tokenizer.json)."""
        return load_tokenizer(self.config.model)

    def encode(self, text: str) -> list[int]:
        return require_tokenizer(self.config.model).encode(text)

    def resubmit(self, prompt_ids: list[int], sampling: Mapping[str, Any], request_id: str,
                 generated: list[int] = (), priority: int = 0, sink: Any = None) -> "RequestHandle":
        """Submit again a request whose scheduler died (and was restarted by Ray), with the tokens
        received so far; it continues exactly where it was (see `Scheduler.resubmit`), its tokens
        going to `sink` (if any) from there. Raises `SchedulerDiedError` if the scheduler is gone
        for good."""
        rid = self._call("resubmit", list(prompt_ids), dict(sampling), request_id, list(generated), priority, sink)
        return RequestHandle(self, rid, list(prompt_ids), dict(sampling), list(generated), priority, sink)

    def vocab_size(self) -> int:
        return self.workers[0]["vocab_size"]

    def stats(self, detail: bool = False) -> dict:
        return self._call("stats", detail)

    def timeline(self) -> list[tuple]:
        return self._call("timeline")

    def check_idle(self) -> dict:
        """Whether every worker pool and every scheduler table is empty."""
        return self._call("check_idle")

    def migrate(self, request_id: str, worker: int | None = None, mode: str = "live") -> dict:
        """Live-migrate a running request to `worker` (None: the scheduler picks). Returns
        {"from", "to", "mode", "stages", "precopy_bytes", "final_bytes", "downtime_s", "reason"};
        mode: live | snapshot (a blocking copy: too many stages) | stayed (not moved: no room,
        or the destination failed) | ended (finished or aborted meanwhile) | recovered (a worker
        failed mid-copy: the request is recomputed). Tokens are those of an unmoved run.
        `mode` "snapshot" / "recompute": the blocking baselines (`raysched bench migrate`)."""
        return self._call("migrate", request_id, worker, mode)

    def drain(self, worker: int) -> dict:
        """Stop admissions to `worker` and move everything on it elsewhere (live where it can,
        by snapshot where it must); returns {"moved", "seconds", "fallbacks"} once it is empty."""
        return self._call("drain", worker)

    def undrain(self, worker: int) -> None:
        """Let a drained worker (not removed) take work again."""
        self._call("undrain", worker)

    def remove_worker(self, worker: int) -> dict:
        """Drain `worker`, then end its actor (the drain's result)."""
        return self._call("remove_worker", worker)

    def add_worker(self) -> dict:
        """Start one more worker; it takes work from the next decision on. Its facts."""
        line = self._call("add_worker")
        self.workers.append(line)
        return line

    def _call(self, method: str, *args: Any) -> Any:
        """The scheduler's `method(*args)`. While Ray restarts a dead scheduler it answers
        "unavailable": the call is made again (up to RESTART_WAIT_S); a scheduler gone for good
        raises `SchedulerDiedError` at once."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                return _get(getattr(self.scheduler, method).remote(*args))
            except SchedulerRestartingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(RESTART_POLL_S)  # polls the restart; the call itself is the check

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the scheduler and workers if this client launched them (a connected client only
        disconnects); stop Ray too if this client started or attached it. The client is closed
        afterwards: any further call raises `ClientClosedError`. A second shutdown does nothing.
        `timeout_s`: how long the scheduler may take to end its workers before it is killed."""
        if self._closed:
            return
        if self._reader is not None:
            self._reader.close()
        if self._sink is not None:
            _kill_quietly(self._sink)  # this client's readers end with it
        if self.owns_scheduler:
            self.stop(timeout_s)
        elif self._owns_ray:
            shutdown_ray()
        self._closed = True

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the scheduler and its workers, whoever started them; then disconnect."""
        from raysched.deployment import stop_scheduler

        stop_scheduler(self.scheduler, timeout_s)
        if self._owns_ray:
            shutdown_ray()
        self._closed = True

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class RequestHandle:
    """One submitted request. It keeps what it needs to survive the scheduler's death: the prompt,
    the sampling parameters, the priority and the tokens received so far (`received`). When the
    scheduler dies and Ray restarts it, `result()` and the streams resubmit the request with those
    tokens and carry on; the continuation is identical (counter-based sampler). If the scheduler is
    gone for good, they raise `SchedulerDiedError`."""

    def __init__(self, client: Client, request_id: str, prompt_ids: list[int], sampling: dict,
                 received: list[int] = (), priority: int = 0, sink: Any = None) -> None:
        self.client = client
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.priority = priority
        self.received: list[int] = list(received)
        self.sink = sink  # where its workers send its tokens (`raysched.sink`), once it is read

    @property
    def scheduler(self) -> Any:
        return self.client.scheduler

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self.client.tokenizer

    @property
    def params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling)

    def result(self, timeout: float | None = None) -> dict:
        """Block until the request ends; its record (token_ids, text when the model has a
        tokenizer, workers, retractions, timings). A stop string ends the text before it."""
        while True:
            try:
                record = _get(self.scheduler.wait.remote(self.request_id), timeout)
                break
            except SchedulerDiedError:
                self.resubmit()
        if self.tokenizer is not None:
            p = self.params
            record["text"] = output_text(self.tokenizer, record["token_ids"], p.stop, p.min_tokens)
        return record

    def stream(self) -> Iterator[int]:
        """Yield tokens as they are generated (after a scheduler restart, only the new ones)."""
        for tokens, _ in self._chunks():
            yield from tokens

    def _chunks(self) -> Iterator[tuple[list[int], bool]]:
        """(new tokens, ended) as they arrive, resubmitting after a scheduler restart: from this
        client's sink, where the workers send them (`raysched.sink`), or through the scheduler
        (submitted without a sink and read while `Client.direct_tokens` is off)."""
        if self.sink is not None or self.client.direct_tokens:
            yield from self._chunks_from_sink()
            return
        done = False
        while not done:
            try:
                tokens, done = _get(self.scheduler.next_tokens.remote(self.request_id, len(self.received)))
            except SchedulerDiedError:
                self.resubmit()
                continue
            self.received.extend(tokens)
            yield tokens, done

    def _chunks_from_sink(self) -> Iterator[tuple[list[int], bool]]:
        """`_chunks` read from the sink. When it stays quiet for SINK_WAIT_S, the scheduler is
        asked how the request stands: gone (restarted by Ray): resubmit it with the tokens
        received; ended (the sink missed its end): the rest from its record."""
        if self.sink is None:
            self.sink = self.client.sink
            if not self._attach():  # it had ended
                tokens = self.result()["token_ids"][len(self.received):]
                self.received.extend(tokens)
                yield tokens, True
                return
        done = False
        while not done:
            tokens, done, error = self.client.read_sink(self.sink, self.request_id, len(self.received), SINK_WAIT_S)
            if error:
                raise RuntimeError(error)
            if not tokens and not done:
                tokens, done = self._look_for_scheduler()
            self.received.extend(tokens)
            yield tokens, done
        self.client.forget_stream(self.sink, self.request_id)

    def _attach(self) -> bool:
        """Have the workers send this request's tokens to `self.sink` from now on; False: it had
        ended. A scheduler that died (or was restarted and forgot the request) gets it again,
        with the tokens received and the sink (`resubmit`)."""
        try:
            return self.client._call("attach_sink", self.request_id, self.sink)
        except SchedulerDiedError:
            pass
        except UnknownRequestError:
            pass
        self.resubmit()
        return True

    def _look_for_scheduler(self) -> tuple[list[int], bool]:
        """The sink went quiet: (tokens, done) from the scheduler's record if the request ended;
        a resubmission if the scheduler forgot it (it died); nothing if it is live or busy."""
        try:
            status = _get(self.scheduler.status.remote(self.request_id), STATUS_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            return [], False  # busy (or blocked): its workers send on regardless
        except SchedulerDiedError:
            self.resubmit()
            return [], False
        if status == "unknown":
            self.resubmit()
        elif status == "ended":
            record = _get(self.scheduler.wait.remote(self.request_id))
            return record["token_ids"][len(self.received):], True
        return [], False

    def stream_text(self) -> Iterator[tuple[str, list[int]]]:
        """Yield (text, token_ids) as tokens arrive: the text is whole characters only and stops
        before a stop string (see `raysched.tokenizer.TextStream`)."""
        if self.tokenizer is None:
            raise RequestError("stream_text: the model has no tokenizer; use stream() for token ids")
        text = self.tokenizer.text_stream(self.params.stop, self.params.min_tokens)
        delta = text.add(list(self.received))  # tokens received before a restart, if any
        for tokens, done in self._chunks():
            delta += text.add(tokens) + (text.finish() if done else "")
            if delta or tokens:
                yield delta, tokens
            delta = ""

    def resubmit(self) -> None:
        """The scheduler died: hand the request, with the tokens received, to its restarted self.
        Raises SchedulerDiedError when there is none (the actor is dead for good)."""
        try:
            self.client.resubmit(self.prompt_ids, self.sampling, self.request_id, self.received,
                                 self.priority, self.sink)
        except RequestIdInUseError:
            pass  # the scheduler never died (a call failed in transit): it still has it

    def abort(self) -> bool:
        return _get(self.scheduler.abort.remote(self.request_id))


def _kill_quietly(actor: Any) -> None:
    """End an actor this process owns; one already gone (or Ray already down) is fine."""
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - nothing to end is not an error here
        pass
