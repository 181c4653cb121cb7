"""`--cancel-hook`: the call a backend needs, besides the closed connection, to stop abandoned work.

Closing the upstream connection stops vLLM, llama.cpp, SGLang, LMDeploy and TGI. Some set-ups keep
generating anyway: llama-server with an `X-Conversation-Id` keeps a stream running for replay until
`DELETE /v1/stream?conv_id=ID`; SGLang and LMDeploy have abort endpoints that act at once. A hook is
one such call, fired when the proxy cancelled an upstream request (the client left or stalled, a
timeout, shutdown). Hooks run as kept-referenced background tasks with a short timeout: they never
delay the exchange, and their failures are only counted and logged.

Forms (`--cancel-hook` is repeatable; `STREAMWARDEN_CANCEL_HOOK` holds one hook per line):

    llama-conversation                          DELETE /v1/stream?conv_id={conversation_id}
    'METHOD /path [JSON body]'                  e.g. 'POST /abort_request {"rid": "{request_id}"}'

`{request_id}` is the exchange's `X-Request-Id` (the one sent upstream); `{conversation_id}` is the
client's `X-Conversation-Id` header (a hook that needs it is skipped when the request had none).
Values are percent-encoded in the path and JSON-escaped in the body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from proxy.config import CONVERSATION_HEADER, CancelHook, HookCall
from proxy.core.lifecycle import HOOKED_CANCELLATIONS, Cancellation
from proxy.core.record import ExchangeRecord
from proxy.observe.metrics import CANCEL_HOOK_FAILURE_REASONS, Metrics

__all__ = ["HOOK_FAILURE_REASONS", "CancelHooks"]

HOOK_TIMEOUT = 2.0  # seconds for one hook call, connect included
HOOK_FAILURE_REASONS = CANCEL_HOOK_FAILURE_REASONS


class CancelHooks:
    """Fires the configured hooks for exchanges whose upstream the proxy cancelled.

    Calls go through the proxy's own upstream session (so they get its connect timeout and TLS set-up);
    the server awaits the ones still in flight at shutdown, before that session closes.
    """

    def __init__(
        self,
        hooks: tuple[CancelHook, ...],
        upstream_base: str,
        upstream_authorization: str | None,
        metrics: Metrics,
        logger: Any,
        timeout: float = HOOK_TIMEOUT,
    ) -> None:
        self.hooks = hooks
        self.timeout = timeout  # seconds per call, connect included
        self._base = upstream_base
        self._authorization = upstream_authorization
        self._metrics = metrics
        self._logger = logger
        self._tasks: set[asyncio.Task[None]] = set()

    def fire(
        self, ex: ExchangeRecord, request_headers: Mapping[str, str], session: aiohttp.ClientSession | None
    ) -> None:
        """Start the hooks for `ex` if the proxy cancelled its upstream request; never blocks."""
        if not self.hooks or ex.upstream_cancelled not in HOOKED_CANCELLATIONS or ex.drained or session is None:
            return
        conversation = request_headers.get(CONVERSATION_HEADER)
        headers = {"X-Request-Id": ex.request_id}
        authorization = request_headers.get("Authorization") or self._authorization
        if authorization:
            headers["Authorization"] = authorization  # the key the client used; backends guard these routes
        for hook in self.hooks:
            call = hook.render(ex.request_id, conversation)
            if call is None:
                continue
            task = asyncio.get_running_loop().create_task(self._call(session, hook, call, ex, headers))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _call(
        self,
        session: aiohttp.ClientSession,
        hook: CancelHook,
        call: HookCall,
        ex: ExchangeRecord,
        headers: dict[str, str],
    ) -> None:
        self._metrics.cancellations.labels(api=ex.api, reason=str(Cancellation.CANCEL_HOOK)).inc()
        failure: str | None = None
        status: int | None = None
        if call.body is not None:
            try:
                orjson.loads(call.body)
            except orjson.JSONDecodeError:
                failure = "invalid_body"  # e.g. a non-numeric conversation id in a numeric field
        if failure is None:
            sent = dict(headers, **({"Content-Type": "application/json"} if call.body is not None else {}))
            try:
                async with asyncio.timeout(self.timeout):
                    async with session.request(
                        call.method, self._base + call.path, data=call.body, headers=sent, allow_redirects=False
                    ) as resp:
                        status = resp.status
                        await resp.read()
                if status >= 400:
                    failure = "http_status"
            except TimeoutError:
                failure = "timeout"
            except (aiohttp.ClientError, OSError, RuntimeError):  # RuntimeError: the session closed meanwhile
                failure = "connect_failed"
        if failure is not None:
            self._metrics.cancel_hook_failures.labels(api=ex.api, reason=failure).inc()
        self._logger.info(
            "cancel_hook",
            request_id=ex.request_id,
            hook=hook.name,
            method=call.method,
            path=call.path.split("?", 1)[0],
            status=status,
            failure=failure,
        )

    async def close(self) -> None:
        """Let the calls in flight finish (each is bounded by the hook timeout); for shutdown."""
        if not self._tasks:
            return
        await asyncio.wait(set(self._tasks), timeout=self.timeout + 1)
        for task in set(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
