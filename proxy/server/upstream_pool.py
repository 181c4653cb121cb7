"""The upstream keep-alive pool, closed to bytes that belong to no request.

aiohttp parses whatever arrives on a pooled idle connection as the answer to the next request sent
on it. A backend that writes a second, unrequested response (or anything else) on an idle
keep-alive connection would thus hand one client's bytes to the next client, and shift every later
answer by one. Here an idle pooled connection that receives any byte is closed at once and never
reused; a connection whose response left bytes beyond its declared end is already closed on
release by aiohttp (`should_close`); EOF closes it too.

This hooks two private parts of aiohttp's connector (`_factory`, `_release`); the loopback tests
with a raw-socket upstream that writes stray responses fail if aiohttp ever changes them.
"""

from __future__ import annotations

import functools
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler

__all__ = ["GuardedConnector", "GuardedResponseHandler"]


class GuardedResponseHandler(ResponseHandler):
    """An upstream connection that knows whether a request is waiting for its bytes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pooled = False  # released to the pool: nothing may arrive until the next request

    def set_response_params(self, **kwargs: Any) -> None:
        self.pooled = False  # aiohttp calls this for every request it sends on the connection
        super().set_response_params(**kwargs)

    def data_received(self, data: bytes) -> None:
        if self.pooled and data:
            self.close()  # stray bytes on an idle connection: no client may ever read them
            return
        super().data_received(data)


class GuardedConnector(aiohttp.TCPConnector):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(GuardedResponseHandler, loop=self._loop)  # type: ignore[assignment]

    def _release(self, key: Any, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        if isinstance(protocol, GuardedResponseHandler):
            protocol.pooled = True
        super()._release(key, protocol, should_close=should_close)
