"""coord.stats(), log lines without secrets, and OpenTelemetry metrics and spans."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

import asynclock
from asynclock.backends import MemoryBackend
from asynclock.testing import ManualClock


class TestStats:
    async def test_counters_and_latencies(self) -> None:
        """stats() counts acquisitions, releases, timeouts, losses and renewals, and
        summarises latencies."""
        clock = ManualClock()
        backend = MemoryBackend(clock=clock)
        async with asynclock.Coordinator(backend) as coord:
            for _ in range(3):
                async with coord.lock("a", ttl=9):
                    pass
            held = await coord.lock("b", ttl=9).acquire()
            with pytest.raises(asynclock.LockTimeout):
                await coord.lock("b", timeout=0).acquire()
            await clock.advance(3.5)  # one renewal of "b"
            lost = await coord.lock("c", ttl=9).acquire()
            backend.drop("c")
            await clock.advance(3.5)  # its renewal is refused
            stats = coord.stats()
            assert lost.lost
            assert (stats.acquisitions, stats.releases, stats.timeouts) == (5, 3, 1)
            assert stats.losses == 1
            assert stats.renewals >= 2
            assert stats.renewal_failures == 1
            assert stats.held == 1
            assert stats.waiting == 0
            assert stats.acquire_latency.count == 5
            assert 0 <= stats.acquire_latency.p50 <= stats.acquire_latency.max
            await held.release()


class TestLogs:
    async def test_no_password_in_logs(
        self, asynclock_redis_url: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Nothing asynclock logs, at any level, shows a password from the URL."""
        caplog.set_level(logging.DEBUG, logger="asynclock")
        url = asynclock_redis_url.replace("redis://", "redis://alice:s3cr3t-pw@")
        async with asynclock.connect(url) as coord:
            with pytest.raises(asynclock.BackendError):
                await coord.lock("x").acquire()
        async with asynclock.connect(asynclock_redis_url) as coord, coord.lock("x"):
            pass
        assert caplog.records  # it did log
        for record in caplog.records:
            assert "s3cr3t-pw" not in record.getMessage()
            assert "s3cr3t-pw" not in caplog.text

    async def test_structured_fields(self, caplog: pytest.LogCaptureFixture) -> None:
        """Log records carry the lock name and fence as fields."""
        caplog.set_level(logging.DEBUG, logger="asynclock")
        async with asynclock.Coordinator(MemoryBackend()) as coord, coord.lock("job:1") as lease:
            pass
        acquired = [r for r in caplog.records if r.getMessage().startswith("acquired")]
        assert acquired
        assert acquired[0].asynclock_lock == "job:1"  # type: ignore[attr-defined]
        assert acquired[0].asynclock_fence == lease.fence  # type: ignore[attr-defined]


OTEL_SCRIPT = textwrap.dedent(
    """
    import asyncio, json
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    import asynclock

    async def main():
        async with asynclock.connect("memory://otel") as coord:
            for _ in range(2):
                async with coord.lock("job:42", ttl=5):
                    pass
            async with coord.lock("job:42", ttl=5):
                try:  # another task's acquire (this one's would be a re-entry)
                    await asyncio.create_task(coord.lock("job:42", timeout=0).acquire())
                except asynclock.LockTimeout:
                    pass

    asyncio.run(main())
    spans = [
        {"name": s.name, "attributes": dict(s.attributes), "status": s.status.status_code.name}
        for s in exporter.get_finished_spans()
    ]
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points[m.name] = [
                    {"attributes": dict(p.attributes), "value": getattr(p, "value", None),
                     "count": getattr(p, "count", None)}
                    for p in m.data.data_points
                ]
    print(json.dumps({"spans": spans, "metrics": points}))
    """
)


# A release confirmed after its lease was marked lost (the validity ran out while the
# release was in flight): one loss was recorded, then the release. The lease stopped
# being held once, so ``asynclock.leases.held`` must come back to 0.
RELEASE_AFTER_LOSS_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    import asynclock
    from pytest_asynclock.proxy import FaultProxy

    async def main(url, prefix):
        async with FaultProxy.from_url(url) as proxy:
            async with asynclock.connect(proxy.url_for(url), prefix=prefix) as coord:
                async with coord.lock("x", ttl=3, renew=False):
                    pass  # the server knows the release script now: one round trip
                async with coord.lock("x", ttl=3, renew=False) as lease:
                    proxy.set_latency(0.6 * lease.expires_in)
                proxy.heal()
                stats = coord.stats()
                return {"lost": lease.lost, "losses": stats.losses,
                        "releases": stats.releases}

    seen = asyncio.run(main(sys.argv[1], sys.argv[2]))
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                seen[m.name] = sum(getattr(p, "value", 0) for p in m.data.data_points)
    print(json.dumps(seen))
    """
)


class TestOpenTelemetry:
    def test_held_comes_back_to_zero_after_a_release_confirmed_late(
        self, asynclock_redis_url: str, namespace: str
    ) -> None:
        """A lease marked lost while its confirmed release was in flight ends released:
        ``asynclock.leases.held`` went down once (at the loss), not twice."""
        done = subprocess.run(  # noqa: S603 - our own script, our own interpreter
            [sys.executable, "-c", RELEASE_AFTER_LOSS_SCRIPT, asynclock_redis_url, namespace],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["lost"] is False
        assert (seen["losses"], seen["releases"]) == (1, 2)
        assert seen["asynclock.leases.held"] == 0, seen

    def test_metrics_and_spans_recorded(self) -> None:
        """With an OpenTelemetry SDK set up, locks record the documented metrics and
        spans (in a separate process: OpenTelemetry's providers are process-global)."""
        done = subprocess.run(  # noqa: S603 - our own script, our own interpreter
            [sys.executable, "-c", OTEL_SCRIPT],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        names = [span["name"] for span in report["spans"]]
        assert names.count("asynclock.acquire") == 4
        assert names.count("asynclock.release") == 3
        granted = [
            s
            for s in report["spans"]
            if s["name"] == "asynclock.acquire" and s["status"] != "ERROR"
        ]
        assert granted[0]["attributes"]["asynclock.lock.name"] == "job:42"
        assert granted[0]["attributes"]["asynclock.lock.fence"] >= 1
        assert any(s["status"] == "ERROR" for s in report["spans"])  # the timeout
        metrics = report["metrics"]
        outcomes = {
            p["attributes"]["asynclock.outcome"]: p["value"]
            for p in metrics["asynclock.acquisitions"]
        }
        assert outcomes == {"acquired": 3, "timeout": 1}
        assert metrics["asynclock.acquire.duration"][0]["count"] == 3
        assert metrics["asynclock.releases"][0]["value"] == 3
        assert metrics["asynclock.leases.held"][0]["value"] == 0
        for point in metrics["asynclock.acquisitions"]:
            assert point["attributes"]["asynclock.backend"] == "MemoryBackend"
            assert "job:42" not in json.dumps(point)  # names stay off metrics
