"""The gateway's metrics: forwarded calls by outcome, and retries.

Its spans (``gateway.forward``, one per forwarded call, around the attempts) are made in
``squall_server.gateway.forward``; the metrics are the ones an operator alerts on when the
cluster is healthy but apps see failures.
"""

from __future__ import annotations

from squall_server.common.telemetry import Telemetry


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


def instruments(telemetry: Telemetry) -> GatewayInstruments:
    """The gateway instruments of this telemetry."""
    return telemetry.instruments("gateway", GatewayInstruments)
