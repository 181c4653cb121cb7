"""The fault-injecting fake upstream: a realistic OpenAI/Anthropic-compatible backend that breaks on demand.

It is both a product feature (``streamwarden fake-upstream``: point a client at it, directly or through
the proxy, and watch each failure) and the test suite's upstream. Serve it with
``handler_cancellation=True`` (``run`` does, and so does aiohttp 3.14's test server behind
``aiohttp_server(build_app())``, which rejects the keyword given twice), so that a client that leaves
cancels the handler at once and shows up in ``app[RECORDER]``. Scenarios and their parameters:
``proxy.tools.fake.scenarios`` and ``describe()``.
"""

from proxy.tools.fake.app import RATE_HEADER, build_app, run
from proxy.tools.fake.exchange import FakeSettings
from proxy.tools.fake.faults import FAULT_HEADER, FAULT_KEY_HEADER, MODEL_PREFIX
from proxy.tools.fake.quirks import STATS
from proxy.tools.fake.recorder import RECORDER, Recorder, RequestRecord
from proxy.tools.fake.scenarios import ScenarioInfo, describe

__all__ = [
    "FAULT_HEADER",
    "FAULT_KEY_HEADER",
    "MODEL_PREFIX",
    "RATE_HEADER",
    "RECORDER",
    "STATS",
    "FakeSettings",
    "Recorder",
    "RequestRecord",
    "ScenarioInfo",
    "build_app",
    "describe",
    "run",
]
