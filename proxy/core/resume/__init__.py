"""Resuming a stream cut mid-answer (`--resume-on-cut`): sans-IO, like the rest of the core.

`rules` says whether a request may be continued at all and builds the continuation's body;
`transcript` keeps what the client has received (text, token ids, the first chunk's identity);
`stitch` rewrites the continuation's events so that the client sees one stream; `count` asks the
backend's tokenizer for the tokens so far where the stream did not say; `resumer` holds one
exchange's budget and decisions.
"""

from __future__ import annotations

from proxy.core.resume.resumer import RESULTS, Resumer
from proxy.core.resume.rules import (
    RESUMABLE_APIS,
    RESUMABLE_REASONS,
    RETRYABLE_STATUSES,
    Refusal,
    continuation_body,
    request_refusal,
)
from proxy.core.resume.stitch import Stitcher
from proxy.core.resume.transcript import Transcript

__all__ = [
    "RESULTS",
    "RESUMABLE_APIS",
    "RESUMABLE_REASONS",
    "RETRYABLE_STATUSES",
    "Refusal",
    "Resumer",
    "Stitcher",
    "Transcript",
    "continuation_body",
    "request_refusal",
]
