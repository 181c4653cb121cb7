"""API dialects: which API a request speaks, and how that API's streams end and fail.

The registry maps (method, path) to one shared, stateless `Dialect` per API (docs/architecture.md); the
`api` metric label is its name. Streaming state lives in the `DialectStream` each exchange gets
from `Dialect.new_stream()`.
"""

from __future__ import annotations

from types import MappingProxyType

from proxy.core.dialects.base import Dialect, DialectStream, Kind, Usage
from proxy.core.dialects.chat import ChatStream
from proxy.core.dialects.errors import ErrorInfo
from proxy.core.dialects.messages import MessagesStream
from proxy.core.dialects.other import OtherStream
from proxy.core.dialects.request import RequestInfo, inspect_request, read_request
from proxy.core.dialects.responses import ResponsesStream

__all__ = [
    "DIALECTS",
    "Dialect",
    "DialectStream",
    "ErrorInfo",
    "Kind",
    "RequestInfo",
    "Usage",
    "for_request",
    "inspect_request",
    "read_request",
]

_ALL = (
    Dialect("chat_completions", json_body=True, anthropic=False, stream_factory=ChatStream),
    Dialect("completions", json_body=True, anthropic=False, stream_factory=ChatStream),
    Dialect("responses", json_body=True, anthropic=False, stream_factory=ResponsesStream),
    Dialect("messages", json_body=True, anthropic=True, stream_factory=MessagesStream),
    Dialect("embeddings", json_body=True, anthropic=False, stream_factory=ChatStream),
    Dialect("models", json_body=True, anthropic=False, stream_factory=ChatStream),
    Dialect("other", json_body=False, anthropic=False, stream_factory=OtherStream),
)
DIALECTS = MappingProxyType({dialect.name: dialect for dialect in _ALL})

_POST = {
    "/chat/completions": DIALECTS["chat_completions"],
    "/completions": DIALECTS["completions"],
    "/responses": DIALECTS["responses"],
    "/messages": DIALECTS["messages"],
    "/embeddings": DIALECTS["embeddings"],
}


def for_request(method: str, path: str) -> Dialect:
    """Classify a request; `path` is the URL path without the query, `/v1` prefix optional."""
    path = path.rstrip("/")
    if path.startswith("/v1/") or path == "/v1":
        path = path[3:]
    method = method.upper()
    if method == "POST":
        found = _POST.get(path)
        if found is not None:
            return found
    elif method == "GET" and (path == "/models" or path.startswith("/models/")):
        return DIALECTS["models"]
    return DIALECTS["other"]
