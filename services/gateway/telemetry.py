"""The gateway's metrics: forwarded calls by outcome, retries, and the shared publish
streams' backlog.

Its spans (``gateway.forward``, one per forwarded call, around the attempts) are made in
``squall_server.gateway.forward``; the metrics are the ones an operator alerts on when the
cluster is healthy but apps see failures, or sees queueing at the gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from opentelemetry import metrics

from squall_server.common.telemetry import Telemetry, on_loop
from squall_server.gateway.shared_publish import Backlog


class GatewayInstruments:
    """Every gateway metric, made once per Telemetry."""

    def __init__(self, telemetry: Telemetry) -> None:
        meter = telemetry.meter
        self.calls = meter.create_counter(
            "squall.gateway.calls",
            unit="{call}",
            description="Calls forwarded to the master, by method and the status answered",
        )
        self.retries = meter.create_counter(
            "squall.gateway.retries",
            unit="{attempt}",
            description="Attempts of forwarded calls beyond the first, by method",
        )
        # Gateway id -> its shared streams' backlog and the loop to read it on.
        self._sources: dict[str, tuple[Callable[[], Backlog], asyncio.AbstractEventLoop]] = {}
        meter.create_observable_gauge(
            "squall.gateway.publish.waiting",
            callbacks=[self._observe_waiting],
            unit="{call}",
            description="Unary publishes waiting at the gateway for room on its shared "
            "publish streams to the master",
        )
        meter.create_observable_gauge(
            "squall.gateway.publish.unanswered",
            callbacks=[self._observe_unanswered],
            unit="{request}",
            description="Requests on the gateway's shared publish streams that the master "
            "has not answered yet",
        )
        meter.create_observable_gauge(
            "squall.gateway.publish.in_flight",
            callbacks=[self._observe_in_flight],
            unit="{call}",
            description="Unary publishes written on the gateway's shared publish streams "
            "that the master has not answered yet (a joined request carries several)",
        )

    def watch(self, gateway_id: str, backlog: Callable[[], Backlog]) -> None:
        """Reports a gateway's shared-stream backlog in the gauges (call on its loop)."""
        self._sources[gateway_id] = (backlog, asyncio.get_running_loop())

    def unwatch(self, gateway_id: str) -> None:
        """Stops reporting the gateway."""
        self._sources.pop(gateway_id, None)

    def _backlogs(self) -> list[tuple[str, Backlog]]:
        readings = []
        for gateway_id, (read, loop) in list(self._sources.items()):
            backlog = on_loop(loop, read)
            if backlog is not None:
                readings.append((gateway_id, backlog))
        return readings

    def _observe_waiting(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(b.waiting, {"node": g}) for g, b in self._backlogs()]

    def _observe_unanswered(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(b.unanswered, {"node": g}) for g, b in self._backlogs()]

    def _observe_in_flight(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(b.in_flight, {"node": g}) for g, b in self._backlogs()]


def instruments(telemetry: Telemetry) -> GatewayInstruments:
    """The gateway instruments of this telemetry."""
    return telemetry.instruments("gateway", GatewayInstruments)
