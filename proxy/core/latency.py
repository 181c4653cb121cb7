"""Token latency of a stream as the proxy forwarded it: inter-token gaps and time per output token.

Sans-IO. The stream loop tells a `TokenGaps` when it forwards content-bearing events (the monotonic
time and how many events went out in that write); the gaps land in a small per-exchange bucket array,
never in a Prometheus histogram directly, because only `ok` streams may feed the latency histograms
(OpenTelemetry defines them for successful responses) and the outcome is known only at the end. The
books then merge the array of an `ok` stream into `GapHistogram` (proxy/observe/gaps.py) in one
step: per event, the cost is one subtraction, one bisect and two additions.

Events forwarded in the same write have a gap of 0 (they reached the client together). So the
histogram's count is `content events - 1` per stream and its sum is `last - first`: `sum / count` over
a window is the mean time per output token, the same quantity as `streamwarden_time_per_output_token`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

__all__ = ["ITL_BUCKETS", "TokenGaps"]

# Fit for 5 ms (a fast small model) to 2.5 s (a long prefill between chunks, a stalling backend).
ITL_BUCKETS = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class TokenGaps:
    """One stream's content-event times: first, last, how many, and its gaps bucketed by `bounds`."""

    __slots__ = ("_bounds", "counts", "events", "first", "last", "total")

    def __init__(self, bounds: Sequence[float] = ITL_BUCKETS) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # non-cumulative; the last slot is +Inf
        self.total = 0.0  # sum of the gaps
        self.events = 0
        self.first = 0.0
        self.last = 0.0

    def note(self, now: float, events: int) -> None:
        """`events` content-bearing events were forwarded at monotonic time `now`."""
        if events <= 0:
            return
        if self.events:
            gap = now - self.last
            if gap < 0.0:  # a clock that went back cannot make a negative latency
                gap = 0.0
            self.counts[bisect_left(self._bounds, gap)] += 1
            self.total += gap
        else:
            self.first = now
        if events > 1:
            self.counts[0] += events - 1  # forwarded together: gap 0, which every bucket holds
        self.events += events
        self.last = now

    @property
    def gaps(self) -> int:
        return self.events - 1 if self.events else 0

    def time_per_output_token(self) -> float | None:
        """(last content - first content) / (content events - 1); None below two events."""
        if self.events < 2:
            return None
        return (self.last - self.first) / (self.events - 1)
