"""`streamwarden check --upstream URL`: which failure modes a backend really shows, and the flags it needs.

A bounded set of small probe requests, one at a time, against a live backend; nothing but the probes is
sent and nothing on the backend is changed. Layout: ``requests`` (what is asked), ``client`` (the one
connection, SSE read with the proxy's reader), ``verdicts`` (sans-IO rules), ``probes`` and ``abandon``
(the probes), ``backends`` (their metrics), ``report`` (findings, table, JSON), ``run`` (order and CLI).
"""

from proxy.tools.check.report import PROBE_IDS, Finding, Report, render_table
from proxy.tools.check.run import CheckOptions, add_arguments, main, options_from_args, run_check

__all__ = [
    "PROBE_IDS",
    "CheckOptions",
    "Finding",
    "Report",
    "add_arguments",
    "main",
    "options_from_args",
    "render_table",
    "run_check",
]
