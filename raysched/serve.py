"""`raysched serve`: an OpenAI-compatible HTTP server on Ray Serve, in front of the named scheduler.

    server = start_server(config, host="127.0.0.1", port=8000, api_key=None)   # returns at once
    ...                                                                         # curl / openai client
    server.stop()

One Serve deployment (`OpenAIServer`, a FastAPI ingress, one replica) finds the scheduler actor by
name in namespace `raysched` and talks to it with plain actor calls: `submit`, then `next_tokens`
(long-polls; the scheduler is async, so thousands of open streams cost it nothing) or `wait`, and
`abort` when the HTTP client goes away. Text is encoded and decoded here, in the replica, with
the model's tokenizer; stop strings are matched by the scheduler (it ends the request at once) and
the text is cut before them here. Routes: GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (both may stream SSE, ending with ``data: [DONE]``), GET /health,
GET /metrics (Prometheus text). Errors are OpenAI's error JSON.
"""


import asyncio
import contextlib
import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from raysched import interrupts
from raysched.cluster import check_port_free, shutdown_ray
from raysched.config import ConfigError, ServeConfig
from raysched.deployment import DEFAULT_NAME, NAMESPACE, describe, find_scheduler, start_scheduler
from raysched.metrics import ServeMetrics
from raysched.openai_api import (APIError, ParsedRequest, chunk, error_body, models_list, new_id, parse_chat,
                                 parse_completion, request_error, response, usage, usage_chunk)
from raysched.sampling import RequestError, RequestIdInUseError, UnknownRequestError
from raysched.tokenizer import load_tokenizer

MAX_BODY_BYTES = 1 << 20  # larger request bodies get 413
MAX_ONGOING_REQUESTS = 4096  # per replica; the scheduler's pools, not Serve, bound the work
SINK_WAIT_S = 2.0  # a stream's read of the replica's sink waits this long before it asks the scheduler
STATUS_WAIT_S = 2.0  # ... which it waits this long for (a busy scheduler: read on)
RESUBMIT_WAIT_S = 120.0  # a request whose scheduler died waits this long for Ray to restart it
RESUBMIT_RETRY_S = 0.5  # ... asking again this often
GONE_AFTER_S = 5.0  # a scheduler that calls say died (not restarting) for this long is gone for good
log = logging.getLogger("raysched.serve")
API_KEY_ENV = "RAYSCHED_API_KEY"

app = FastAPI(title="raysched", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(APIError)
async def _api_error(_: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """404 and 405 in OpenAI's error JSON; a 405 keeps Starlette's `Allow` header."""
    message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
    return JSONResponse(error_body(err.status_code, message), status_code=err.status_code, headers=err.headers)


def served_model_name(model: str) -> str:
    """The `model` id clients send: the preset name, or the checkpoint directory's name."""
    return Path(model).name if os.sep in model else model


# helpers the deployment uses are defined above it: Serve pickles the class when it is declared
async def _json_body(request: Request) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"request body of {length} bytes is larger than {MAX_BODY_BYTES}")
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}") from None


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however the response ends. Starlette
    leaves the iterator suspended at a `yield` when the disconnect (a cancellation or an OSError)
    lands in `send`, and its `finally` then waits for the garbage collector: the request would run
    to its last token with nobody reading. Closing it here runs that `finally` (the abort) at once.
    Serve's `receive` raises TaskCancelledError when the client has gone; here that is the
    disconnect message it means (else the handler's task ends in a logged traceback)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def receive_or_disconnect() -> dict:
            try:
                return await receive()
            except ray.exceptions.TaskCancelledError:
                return {"type": "http.disconnect"}

        try:
            await super().__call__(scope, receive_or_disconnect, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def _quiet_future(ref: Any) -> asyncio.Future:
    """`ref` as an asyncio future whose outcome counts as seen even if nobody awaits it any more
    (a disconnect cancels the awaiting handler while Ray completes the call as cancelled: asyncio
    would log "exception was never retrieved" for it)."""
    future = asyncio.wrap_future(ref.future())
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


async def _await_call(ref: Any, timeout: float | None) -> Any:
    """Await a Ray call from a handler. When the handler's client leaves, Serve cancels the
    handler and Ray cancels the calls it made: such a call raises TaskCancelledError, raised on
    here as what it is, the handler's cancellation (a handler ending with that error leaves
    "Task exception was never retrieved" and a traceback in the log)."""
    try:
        return await asyncio.wait_for(_quiet_future(ref), timeout)
    except ray.exceptions.TaskCancelledError:
        raise asyncio.CancelledError() from None


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # no log line per HTTP request
@serve.ingress(app)
class OpenAIServer:
    """The HTTP face of one scheduler. Per request: parse (400/404 on bad input), submit, stream
    or wait, shape the OpenAI response; abort the request if the client disconnects first."""

    def __init__(self, scheduler_name: str, api_key: str | None = None) -> None:
        self.scheduler_name = scheduler_name
        self.api_key = api_key or None
        self.scheduler = find_scheduler(scheduler_name)
        if self.scheduler is None:
            raise RuntimeError(f"no raysched scheduler named {scheduler_name!r} in namespace {NAMESPACE!r}")
        described = ray.get(self.scheduler.describe.remote())
        config: ServeConfig = described["config"]
        self.model = served_model_name(config.model)
        self.tokenizer = load_tokenizer(config.model)
        self.metrics = ServeMetrics(described["workers"])
        self.created = int(time.time())
        from raysched.sink import AsyncSinkReader, new_sink

        self.sink = new_sink()  # this replica's `raysched.sink.TokenSink`: workers send streamed
        #   requests' tokens there, past the scheduler (started here, so that no request waits
        #   for it)
        self.reader = AsyncSinkReader(self.sink)  # every open stream in one long-poll

    # ------------------------------------------------------------------ routes
    # GET routes answer HEAD too (the same status and headers; the HTTP server sends no body)
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> dict:
        await self._call(self.scheduler.stats.remote(), timeout=10)
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(self) -> Response:
        stats = await self._call(self.scheduler.stats.remote(), timeout=10)
        return Response(self.metrics.render(stats), media_type=ServeMetrics.CONTENT_TYPE)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return models_list(self.model, self.created)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        self._authorize(request)
        return await self._serve(parse_completion(await _json_body(request), self.tokenizer, self.model))

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        self._authorize(request)
        return await self._serve(parse_chat(await _json_body(request), self.tokenizer, self.model))

    # ------------------------------------------------------------------ one request
    async def _serve(self, req: ParsedRequest) -> Any:
        rid = f"http-{uuid.uuid4().hex}"  # ours, so that a cancellation at any await can abort it
        owned = True  # this handler must abort the request unless it ends or a stream takes it over
        try:
            try:
                sink = self.sink if req.stream else None
                await self._call(self.scheduler.submit.remote(req.prompt_ids, req.sampling, rid, stream=req.stream,
                                                              sink=sink, shared_prefix=req.shared_prefix), req=req)
            except APIError:
                owned = False  # refused: nothing to abort
                raise
            if req.stream:
                owned = False
                return ClosingStreamingResponse(self._events(req, rid), media_type="text/event-stream")
            record = await self._record(req, rid, [])
            owned = False
        finally:
            if owned:  # the client went away (Serve cancels the handler): free the slots
                self._abort(rid)
        text, token_ids = self._text(req, record["token_ids"])
        self.metrics.observe(record)
        return response(req, new_id(req.kind), self.model, text, token_ids, record["finish_reason"],
                        self._usage(req, record))

    async def _events(self, req: ParsedRequest, rid: str) -> AsyncIterator[str]:
        """SSE chunks as tokens arrive (from the replica's sink, where the workers send them: TTFT
        and the gaps between tokens do not pass through the scheduler); the last one carries
        finish_reason, then [DONE]."""
        stream = self._text_stream(req)
        resp_id, received, done, ended = new_id(req.kind), [], False, False
        try:
            while not done:
                cursor = len(received)
                tokens, done = await self._next_tokens(req, rid, received)
                text = "" if stream is None else stream.add(tokens) + (stream.finish() if done else "")
                if tokens or text:
                    yield _sse(chunk(req, resp_id, self.model, text, tokens, None, cursor == 0,
                                     self._usage_so_far(req, cursor + len(tokens))))
                received += tokens
            cursor = len(received)
            record = await self._record(req, rid, received)
            ended = True
            self.metrics.observe(record)
            yield _sse(chunk(req, resp_id, self.model, "", [], record["finish_reason"], cursor == 0,
                             self._usage_so_far(req, cursor)))
            if req.include_usage:
                yield _sse(usage_chunk(req, resp_id, self.model, self._usage(req, record)))
            yield "data: [DONE]\n\n"
        except APIError as err:  # the scheduler is gone for good mid-stream: say so in the stream
            yield _sse(err.body())
        finally:
            self.reader.forget(rid)
            if not ended:  # client disconnected (or the stream failed): free the request's slots
                self._abort(rid)

    async def _next_tokens(self, req: ParsedRequest, rid: str, received: list[int]) -> tuple[list[int], bool]:
        """(tokens after those `received`, done) from the sink; when it stays quiet, the scheduler
        is asked how the request stands (ended: the rest of its record; died, or restarted
        without it: submitted again with the tokens received, `_resubmit`)."""
        cursor = len(received)
        tokens, done, error = await self.reader.next(rid, cursor, SINK_WAIT_S)
        if error:
            raise APIError(503, f"the raysched scheduler failed: {error}")
        if tokens or done:
            return tokens, done
        try:
            status = await _await_call(self.scheduler.status.remote(rid), STATUS_WAIT_S)
        except asyncio.TimeoutError:
            return [], False  # busy: the workers send on regardless
        except ray.exceptions.RayActorError:
            status = "unknown"  # it died: Ray restarts it without its requests
        if status == "unknown":
            await self._resubmit(req, rid, received)
        elif status == "ended":
            record = await self._record(req, rid, received)
            return record["token_ids"][cursor:], True
        return [], False

    async def _record(self, req: ParsedRequest, rid: str, received: list[int]) -> dict:
        """The request's record, once it ends. A scheduler that died meanwhile (or restarted
        without it) gets it again with the tokens its client received (`_resubmit`)."""
        while True:
            try:
                return await _await_call(self.scheduler.wait.remote(rid), None)
            except ray.exceptions.RayActorError:
                pass
            except ray.exceptions.RayTaskError as err:
                if not isinstance(err.cause, UnknownRequestError):
                    raise
            await self._resubmit(req, rid, received)

    async def _resubmit(self, req: ParsedRequest, rid: str, received: list[int]) -> None:
        """Submit `rid` to the scheduler Ray restarted, with the tokens its client has received:
        it continues exactly where it was (`Scheduler.resubmit`: recompute, and the sampler's
        draw number goes on), as a `Client`'s requests do. A 503 if no scheduler takes it: none
        restarts in RESUBMIT_WAIT_S, or calls say it died (not restarting) for GONE_AFTER_S."""
        start, sink = time.monotonic(), self.sink if req.stream else None
        while True:
            try:
                await _await_call(self.scheduler.resubmit.remote(req.prompt_ids, req.sampling, rid, list(received),
                                                                 0, sink), None)
                log.info("request %s submitted again to the restarted scheduler (%d tokens received)", rid, len(received))
                return
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, RequestIdInUseError):
                    return  # it never lost the request (a call failed in transit)
                raise
            except ray.exceptions.RayActorError as err:
                waited = time.monotonic() - start
                restarting = isinstance(err, ray.exceptions.ActorUnavailableError)
                if waited > (RESUBMIT_WAIT_S if restarting else GONE_AFTER_S):
                    raise APIError(503, f"the raysched scheduler {self.scheduler_name!r} is gone") from None
            await asyncio.sleep(RESUBMIT_RETRY_S)
            self._refresh()

    def _text_stream(self, req: ParsedRequest) -> Any:
        """The request's `TextStream` (stop strings, min_tokens), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.text_stream(req.sampling["stop"], req.sampling["min_tokens"])

    def _text(self, req: ParsedRequest, token_ids: list[int]) -> tuple[str, list[int]]:
        stream = self._text_stream(req)
        if stream is None:
            return "", token_ids
        stream.add(token_ids)
        stream.finish()
        return stream.text, token_ids

    @staticmethod
    def _usage(req: ParsedRequest, record: dict) -> dict:
        return usage(len(req.prompt_ids), len(record["token_ids"]), record.get("cached_tokens") or 0)

    @staticmethod
    def _usage_so_far(req: ParsedRequest, completion_tokens: int) -> dict | None:
        return usage(len(req.prompt_ids), completion_tokens, None) if req.continuous_usage else None

    def _abort(self, rid: str) -> None:
        """Abort `rid` and have the scheduler forget it (its reader is gone). Sent from a thread
        of its own: Serve cancels a disconnected request's task *recursively*, and a call
        submitted from that task (even in its `finally`) may be cancelled with it, leaving the
        request running with nobody to read it. A new thread submits as no task's child."""
        threading.Thread(target=self._send_abort, args=(rid,), name=f"abort-{rid}", daemon=True).start()

    def _send_abort(self, rid: str) -> None:
        """Counts a disconnect only when it aborted the request (it may have ended meanwhile)."""
        try:
            if ray.get(self.scheduler.abort.remote(rid, True), timeout=60):
                self.metrics.count_disconnect()
        except Exception as err:  # the scheduler is gone or restarting: nothing left to free
            print(f"raysched serve: abort of {rid} failed: {err!r}", flush=True)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")

    async def _call(self, ref: Any, timeout: float | None = None, req: ParsedRequest | None = None) -> Any:
        """Await a scheduler call: a rejected request is a 400 (in the HTTP names of `req`'s
        fields), a dead scheduler a 503."""
        try:
            return await _await_call(ref, timeout)
        except ray.exceptions.ActorUnavailableError:  # Ray is restarting it: requests in flight wait
            raise APIError(503, f"the raysched scheduler {self.scheduler_name!r} is restarting; try again") from None
        except ray.exceptions.RayActorError:
            self._refresh()
            raise APIError(503, f"the raysched scheduler {self.scheduler_name!r} is gone") from None
        except asyncio.TimeoutError:
            raise APIError(503, f"the raysched scheduler {self.scheduler_name!r} does not answer") from None
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, RequestError):
                raise request_error(err.cause, req.max_tokens_field if req else "max_tokens") from None
            raise

    def _refresh(self) -> None:
        """After the scheduler died, pick up a new one started under the same name, if any."""
        handle = find_scheduler(self.scheduler_name)
        if handle is not None:
            self.scheduler = handle


# ---------------------------------------------------------------------------- running it


@dataclass
class Server:
    """A running `raysched serve`: its URL, and what `stop` must undo."""

    url: str
    scheduler_name: str
    owns_ray: bool  # this server connected this process to Ray
    embedded: bool  # ... to a local instance it started itself (which holds everything)
    app_name: str = "raysched"

    def stop(self) -> None:
        """Undo what this server started. Its own embedded Ray instance holds everything (Serve,
        the scheduler, its workers): ending it ends them all at once, with no graceful Serve
        shutdown to wait for (a process-group SIGTERM may have killed Ray's processes already).
        On a cluster it joined, only its own Serve application is deleted: other applications
        there keep serving, and the scheduler it started or found is detached and stays
        (`raysched stop` ends it)."""
        if not self.embedded:
            try:
                serve.delete(self.app_name)
            except Exception as err:  # the cluster is gone or unreachable: nothing left to undo there
                print(f"raysched serve: could not delete Serve application {self.app_name!r}: {err!r}", flush=True)
        if self.owns_ray:
            shutdown_ray()


def start_server(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
                 api_key: str | None = None, name: str = DEFAULT_NAME, num_cpus: int | None = None) -> Server:
    """Start (or reuse) the named scheduler and the HTTP server; returns once both answer.

    The port is checked first (a taken one is a PortInUseError before anything starts). With
    `address` (or RAY_ADDRESS) it joins that cluster and the scheduler it starts is detached
    (it outlives this server; `raysched stop` ends it); an existing scheduler of that name is
    used if it serves the same config, else refused (ConfigError naming both models). Without,
    an embedded local Ray instance holds everything, and `stop` ends it.
    """
    from raysched.client import _init_ray

    check_port_free(host, port)
    owns_ray = _init_ray(config, address, num_cpus)
    embedded = owns_ray and not (address or os.environ.get("RAY_ADDRESS"))
    try:
        interrupts.raise_if_signalled()  # a Ctrl-C held back while Ray started (the CLI's `holding`)
        _check_same_config(config, name)
        # detached in any case: a job's own named actors are invisible to the Serve replicas' job
        start_scheduler(config, name, detached=True, exist_ok=True)
        interrupts.raise_if_signalled()
        serve.start(http_options={"host": host, "port": port})
        with _quiet_serve_logger():  # "Connecting to existing Serve app": the one serve.start made
            deploy_app(name, api_key)
    except BaseException:
        if owns_ray:
            shutdown_ray()
        raise
    return Server(f"http://{host}:{port}", name, owns_ray, embedded)


def _check_same_config(config: ServeConfig, name: str) -> None:
    """A running scheduler of this name must serve `config`; else ConfigError naming both models."""
    handle = find_scheduler(name)
    if handle is None:
        return
    running: ServeConfig = describe(handle)["config"]
    if running != config:
        raise ConfigError(f"the running scheduler {name!r} serves model {running.model!r} with another config "
                          f"than --config (model {config.model!r}); serve it with its own config, or end it "
                          f"first (raysched stop)")


@contextlib.contextmanager
def _quiet_serve_logger() -> Any:
    logger = logging.getLogger("ray.serve")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def deploy_app(scheduler_name: str = DEFAULT_NAME, api_key: str | None = None, app_name: str = "raysched",
               route_prefix: str = "/") -> None:
    """Deploy one OpenAI app on the running Serve instance (several may share it, on other
    prefixes, e.g. one with and one without an API key)."""
    serve.run(OpenAIServer.bind(scheduler_name, api_key), name=app_name, route_prefix=route_prefix)
