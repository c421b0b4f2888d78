"""What a coordinator counts: ``coord.stats()``, log lines, and OpenTelemetry when present.

One :class:`Recorder` per coordinator. Counting is a few attribute increments on the hot
path. OpenTelemetry (the ``otel`` extra) is used when the application has installed a
tracer or meter provider before creating the coordinator (``telemetry=None``, the
default), always (``telemetry=True``: instruments follow a provider set later) or never
(``telemetry=False``). Metric names (all with the attribute ``asynclock.backend``):

- ``asynclock.acquisitions`` (counter): acquire calls, attribute ``asynclock.outcome`` =
  ``acquired`` | ``timeout`` | ``error``;
- ``asynclock.acquire.duration`` (histogram, seconds): from the call to the grant,
  waiting included;
- ``asynclock.releases``, ``asynclock.losses``, ``asynclock.release_failures``
  (counters);
- ``asynclock.renewals`` (counter), attribute ``asynclock.outcome`` = ``renewed`` |
  ``refused`` | ``failed``;
- ``asynclock.leases.held``, ``asynclock.acquires.waiting`` (up-down counters).

Spans: ``asynclock.acquire`` and ``asynclock.release``, with ``asynclock.lock.name``,
``asynclock.backend`` and, once granted, ``asynclock.lock.fence``. Lock names go on spans
only, never on metrics (unbounded cardinality).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from ._errors import BackendError, LockTimeout

__all__ = ("CoordinatorStats", "LatencySummary", "Recorder")

logger = logging.getLogger("asynclock")

try:  # the ``otel`` extra
    from opentelemetry import metrics as _otel_metrics
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - exercised where opentelemetry is absent
    _otel_metrics = None  # type: ignore[assignment]
    _otel_trace = None  # type: ignore[assignment]

# Latency samples kept for the summaries: the most recent ones.
_SAMPLES = 1024


def _configured(provider: object) -> bool:
    """True unless ``provider`` is OpenTelemetry's proxy or no-op default."""
    name = type(provider).__name__
    return "Proxy" not in name and "NoOp" not in name


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Seconds, over the most recent samples (up to 1024)."""

    count: int
    mean: float
    p50: float
    p99: float
    max: float


def _log_lease(level: int, message: str, name: str, fence: int, *args: object) -> None:
    """Log ``message`` about the lease ``fence`` on lock ``name`` (its first two
    arguments, then ``args``), with both as the record's ``asynclock_lock`` and
    ``asynclock_fence`` attributes."""
    if logger.isEnabledFor(level):
        extra = {"asynclock_lock": name, "asynclock_fence": fence}
        # stacklevel: the record names the method that logs, not this helper.
        logger.log(level, message, name, fence, *args, extra=extra, stacklevel=2)


def _summary(samples: deque[float]) -> LatencySummary:
    if not samples:
        return LatencySummary(0, 0.0, 0.0, 0.0, 0.0)
    ordered = sorted(samples)
    n = len(ordered)
    return LatencySummary(
        n,
        statistics.fmean(ordered),
        ordered[n // 2],
        ordered[min(n - 1, round(0.99 * (n - 1)))],
        ordered[-1],
    )


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """A snapshot of ``coord.stats()``: gauges now, counters since the coordinator began.

    ``held``: leases held now; ``waiting``: acquire calls in progress; ``acquisitions``,
    ``timeouts``, ``errors``: acquire calls granted, timed out, failed on the backend;
    ``releases``, ``losses``; ``renewals``, ``renewal_failures`` (refused or failed);
    ``acquire_latency`` (call to grant, waiting included) and ``renewal_latency`` (one
    renewal request for a batch); ``late_grants``: grants whose reply came when their
    lease had (almost) no local validity left, given back instead of handed to a body;
    ``release_failures``: releases the server did not confirm (a backend error: they go
    on in the background until it confirms or the TTL ends).
    """

    held: int
    waiting: int
    acquisitions: int
    timeouts: int
    errors: int
    releases: int
    losses: int
    renewals: int
    renewal_failures: int
    acquire_latency: LatencySummary
    renewal_latency: LatencySummary
    late_grants: int = 0
    release_failures: int = 0


class Recorder:
    """Counters, latency samples, log lines and (optionally) OpenTelemetry instruments."""

    def __init__(self, backend: str, telemetry: bool | None) -> None:
        self.backend = backend
        self.waiting = 0
        self.acquisitions = 0
        self.timeouts = 0
        self.errors = 0
        self.releases = 0
        self.losses = 0
        self.renewals = 0
        self.renewal_failures = 0
        self.late_grants = 0
        self.release_failures = 0
        self.acquire_samples: deque[float] = deque(maxlen=_SAMPLES)
        self.renewal_samples: deque[float] = deque(maxlen=_SAMPLES)
        self._attributes = {"asynclock.backend": backend}
        self.tracer: Any = None
        self._meter: Any = None
        if telemetry is False or _otel_metrics is None or _otel_trace is None:
            return
        # By default only what the application has set up: instruments on OpenTelemetry's
        # placeholder providers cost µs per lock and report nothing.
        if telemetry or _configured(_otel_trace.get_tracer_provider()):
            self.tracer = _otel_trace.get_tracer("asynclock")
        if telemetry or _configured(_otel_metrics.get_meter_provider()):
            meter = self._meter = _otel_metrics.get_meter("asynclock")
            self._acquisitions = meter.create_counter(
                "asynclock.acquisitions", description="acquire calls, by outcome"
            )
            self._duration = meter.create_histogram(
                "asynclock.acquire.duration", unit="s", description="call to grant"
            )
            self._releases = meter.create_counter("asynclock.releases")
            self._losses = meter.create_counter("asynclock.losses")
            self._release_failures = meter.create_counter("asynclock.release_failures")
            self._renewals = meter.create_counter(
                "asynclock.renewals", description="lease renewals, by outcome"
            )
            self._held = meter.create_up_down_counter("asynclock.leases.held")
            self._waiting = meter.create_up_down_counter("asynclock.acquires.waiting")

    @property
    def telemetry(self) -> bool:
        """True when OpenTelemetry metrics or spans are in use."""
        return self._meter is not None or self.tracer is not None

    # -- events ----------------------------------------------------------------------

    def started(self) -> None:
        self.waiting += 1
        if self._meter is not None:
            self._waiting.add(1, self._attributes)

    def acquired(self, name: str, fence: int, seconds: float) -> None:
        self.waiting -= 1
        self.acquisitions += 1
        self.acquire_samples.append(seconds)
        if logger.isEnabledFor(logging.DEBUG):  # the hot path: no call when not logging
            ms = seconds * 1000
            _log_lease(logging.DEBUG, "acquired %r fence=%d in %.3f ms", name, fence, ms)
        if self._meter is not None:
            self._waiting.add(-1, self._attributes)
            self._held.add(1, self._attributes)
            self._acquisitions.add(1, {**self._attributes, "asynclock.outcome": "acquired"})
            self._duration.record(seconds, self._attributes)

    def failed(self, name: str, error: BaseException) -> None:
        """An acquire call ended without a lease (timeout, backend error, cancel)."""
        self.waiting -= 1
        outcome = "cancelled"
        if isinstance(error, LockTimeout):
            self.timeouts += 1
            outcome = "timeout"
        elif isinstance(error, BackendError):
            self.errors += 1
            outcome = "error"
            logger.warning("acquire of %r failed: %s", name, error, extra={"asynclock_lock": name})
        if self._meter is not None:
            self._waiting.add(-1, self._attributes)
            if outcome != "cancelled":
                self._acquisitions.add(1, {**self._attributes, "asynclock.outcome": outcome})

    def late_grant(self, name: str, left: float) -> None:
        """A grant arrived with ``left`` seconds of local validity: given back."""
        self.late_grants += 1
        logger.warning(
            "lock %r was granted with %.1f ms of its lease left (a slow reply): given back",
            name,
            left * 1000,
            extra={"asynclock_lock": name},
        )

    def released(self, name: str, fence: int) -> None:
        self.releases += 1
        if logger.isEnabledFor(logging.DEBUG):
            _log_lease(logging.DEBUG, "released %r fence=%d", name, fence)
        if self._meter is not None:
            self._releases.add(1, self._attributes)
            self._held.add(-1, self._attributes)

    def released_after_loss(self, name: str, fence: int) -> None:
        """A lease recorded as lost ended released after all (its release, in flight
        when the loss was noticed, was confirmed): one more release; it stopped being
        held at the loss already."""
        self.releases += 1
        _log_lease(
            logging.INFO,
            "release of %r (fence %d) was confirmed after its lease was marked lost: "
            "it ends released",
            name,
            fence,
        )
        if self._meter is not None:
            self._releases.add(1, self._attributes)

    def release_failed(self) -> None:
        """A release was not confirmed (a backend error); it goes on in the background."""
        self.release_failures += 1
        if self._meter is not None:
            self._release_failures.add(1, self._attributes)

    def lost(self, name: str, fence: int, reason: str) -> None:
        self.losses += 1
        _log_lease(logging.WARNING, "lease on %r (fence %d) lost: %s", name, fence, reason)
        if self._meter is not None:
            self._losses.add(1, self._attributes)
            self._held.add(-1, self._attributes)

    def renewed(self, renewed: int, refused: int, failed: int, seconds: float) -> None:
        self.renewals += renewed
        self.renewal_failures += refused + failed
        self.renewal_samples.append(seconds)
        if failed:
            logger.warning("renewal of %d leases could not be confirmed; retrying", failed)
        if self._meter is not None:
            for outcome, count in (("renewed", renewed), ("refused", refused), ("failed", failed)):
                if count:
                    self._renewals.add(count, {**self._attributes, "asynclock.outcome": outcome})

    def snapshot(self, held: int) -> CoordinatorStats:
        return CoordinatorStats(
            held=held,
            waiting=self.waiting,
            acquisitions=self.acquisitions,
            timeouts=self.timeouts,
            errors=self.errors,
            releases=self.releases,
            losses=self.losses,
            renewals=self.renewals,
            renewal_failures=self.renewal_failures,
            acquire_latency=_summary(self.acquire_samples),
            renewal_latency=_summary(self.renewal_samples),
            late_grants=self.late_grants,
            release_failures=self.release_failures,
        )
