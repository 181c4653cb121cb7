"""`--cancel-hook`: the call a backend needs, besides the closed connection, to stop abandoned work.

Closing the upstream connection stops vLLM, llama.cpp, SGLang, LMDeploy and TGI. Some set-ups keep
generating anyway: llama-server with an `X-Conversation-Id` keeps a stream running for replay until
`DELETE /v1/stream?conv_id=ID`; SGLang and LMDeploy have abort endpoints that act at once. A hook is
one such call, fired when the proxy cancelled an upstream request (the client left or stalled, a
timeout, shutdown). Hooks run as kept-referenced background tasks with a short timeout: they never
delay the exchange, and their failures are only counted and logged (an exception in a hook too: it
is the hook's failure, never the exchange's outcome).

Hooks have connections of their own (a small pool, at most `max_in_flight` calls at once; more are
dropped and counted): a backend that never answers its abort route must not take the connections
the proxy's requests need, nor can a burst of abandons open thousands of sockets. At shutdown, the
calls still in flight are cut at the drain's end.

Forms (`--cancel-hook` is repeatable; `STREAMWARDEN_CANCEL_HOOK` holds one hook per line):

    llama-conversation                          DELETE /v1/stream?conv_id={conversation_id}
    'METHOD /path [JSON body]'                  e.g. 'POST /abort_request {"rid": "{request_id}"}'

`{request_id}` is the exchange's `X-Request-Id` (the one sent upstream); `{conversation_id}` is the
client's `X-Conversation-Id` header (a hook that needs it is skipped when the request had none).
Values are percent-encoded in the path (dots too) and always JSON strings in the body; ids longer
than a request id may be (200 characters) are not sent (proxy/config.py renders the calls).

`Background` holds the other tasks that outlive the handler that started them (a drain), kept
referenced and ended on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Mapping
from typing import Any

import aiohttp
from yarl import URL

from proxy.config import CONVERSATION_HEADER, CancelHook, HookCall, UnsendableId
from proxy.core.lifecycle import HOOKED_CANCELLATIONS, Cancellation
from proxy.core.record import ExchangeRecord
from proxy.observe.metrics import CANCEL_HOOK_FAILURE_REASONS, Metrics

__all__ = ["HOOK_FAILURE_REASONS", "HOOK_MAX_IN_FLIGHT", "Background", "CancelHooks"]

HOOK_TIMEOUT = 2.0  # seconds for one hook call, connect included
HOOK_MAX_IN_FLIGHT = 32  # calls at once (and so connections); a burst past it is dropped and counted
HOOK_FAILURE_REASONS = CANCEL_HOOK_FAILURE_REASONS


class CancelHooks:
    """Fires the configured hooks for exchanges whose upstream the proxy cancelled.

    Calls go through a session of their own, opened at the first call: the proxy's upstream pool is
    for requests. The server cuts the ones still in flight at the drain's end (`close`).
    """

    def __init__(
        self,
        hooks: tuple[CancelHook, ...],
        upstream_base: str,
        upstream_authorization: str | None,
        metrics: Metrics,
        logger: Any,
        timeout: float = HOOK_TIMEOUT,
        max_in_flight: int = HOOK_MAX_IN_FLIGHT,
    ) -> None:
        self.hooks = hooks
        self.timeout = timeout  # seconds per call, connect included
        self.max_in_flight = max_in_flight
        self._base = upstream_base
        self._authorization = upstream_authorization
        self._metrics = metrics
        self._logger = logger
        self._tasks = Background()  # the calls in flight
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def fire(self, ex: ExchangeRecord, request_headers: Mapping[str, str]) -> None:
        """Start the hooks for `ex` if the proxy cancelled its upstream request; never blocks, never raises."""
        if not self.hooks or ex.upstream_cancelled not in HOOKED_CANCELLATIONS or ex.drained:
            return
        for hook in self.hooks:
            try:
                self._fire_one(hook, ex, request_headers)
            except Exception:  # a bug here is this hook's failure, never the exchange's (it is booked already)
                self._failed(ex, "error")
                self._logger.exception("cancel_hook_error", request_id=ex.request_id, hook=hook.name)

    def _fire_one(self, hook: CancelHook, ex: ExchangeRecord, request_headers: Mapping[str, str]) -> None:
        try:
            call = hook.render(ex.request_id, request_headers.get(CONVERSATION_HEADER))
        except UnsendableId as exc:
            self._failed(ex, "invalid_id")
            self._logger.info("cancel_hook", request_id=ex.request_id, hook=hook.name, failure="invalid_id",
                              why=str(exc))
            return
        if call is None:
            return
        if self._closed or len(self._tasks) >= self.max_in_flight:
            self._failed(ex, "dropped")
            self._logger.info("cancel_hook", request_id=ex.request_id, hook=hook.name, failure="dropped",
                              in_flight=len(self._tasks))
            return
        headers = {"X-Request-Id": ex.request_id}
        authorization = request_headers.get("Authorization") or self._authorization
        if authorization:
            headers["Authorization"] = authorization  # the key the client used; backends guard these routes
        self._tasks.spawn(self._call(hook, call, ex, headers))

    def _failed(self, ex: ExchangeRecord, reason: str) -> None:
        self._metrics.cancel_hook_failures.labels(api=ex.api, reason=reason).inc()

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_in_flight, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None),  # each call is bounded by self.timeout
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
            )
        return self._session

    async def _call(self, hook: CancelHook, call: HookCall, ex: ExchangeRecord, headers: dict[str, str]) -> None:
        self._metrics.cancellations.labels(api=ex.api, reason=str(Cancellation.CANCEL_HOOK)).inc()
        failure: str | None = None
        status: int | None = None
        # (A body is valid JSON by construction: proxy/config.py renders every placeholder as a string.)
        sent = dict(headers, **({"Content-Type": "application/json"} if call.body is not None else {}))
        url = URL(self._base + call.path, encoded=True)  # as rendered: no re-quoting, no dot removal
        try:
            async with asyncio.timeout(self.timeout):
                async with self._open_session().request(
                    call.method, url, data=call.body, headers=sent, allow_redirects=False
                ) as resp:
                    status = resp.status
                    await resp.read()
            if status >= 400:
                failure = "http_status"
        except TimeoutError:
            failure = "timeout"
        except (aiohttp.ClientError, OSError, RuntimeError):  # RuntimeError: the session closed meanwhile
            failure = "connect_failed"
        except asyncio.CancelledError:
            self._finish(hook, call, ex, status, "cut")  # the drain ended with this call in flight
            raise
        except Exception:  # e.g. a header value aiohttp cannot encode: this hook's failure, logged
            failure = "error"
            self._logger.exception("cancel_hook_error", request_id=ex.request_id, hook=hook.name)
        self._finish(hook, call, ex, status, failure)

    def _finish(self, hook: CancelHook, call: HookCall, ex: ExchangeRecord, status: int | None,
                failure: str | None) -> None:
        if failure is not None:
            self._failed(ex, failure)
        self._logger.info(
            "cancel_hook", request_id=ex.request_id, hook=hook.name, method=call.method,
            path=call.path.split("?", 1)[0], status=status, failure=failure,
        )

    async def close(self, within: float = 0.0) -> None:
        """For shutdown: the calls in flight get up to `within` seconds (the drain's end), then are cut."""
        self._closed = True
        await self._tasks.close(grace=within)
        if self._session is not None:
            await self._session.close()


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, grace: float = 0.0) -> None:
        """Give what still runs up to `grace` seconds, then cancel it and wait for it to unwind (its
        `finally` writes its books)."""
        if self._tasks and grace > 0:
            await asyncio.wait(set(self._tasks), timeout=grace)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
