"""Prometheus metrics of the sandbox service (one registry per service instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SandboxMetrics:
    """The service's counters; ``registry`` is what ``GET /metrics`` exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "spade_sandbox_requests", "Requests by operation and result code.", ["op", "code"], registry=self.registry
        )
        self.validations = Counter(
            "spade_sandbox_validations", "Validation reports by verdict.", ["valid"], registry=self.registry
        )
        self.failed_checks = Counter(
            "spade_sandbox_failed_checks", "Failed validation checks by name.", ["check"], registry=self.registry
        )
        self.executions = Counter(
            "spade_sandbox_executions", "Executions by status.", ["status"], registry=self.registry
        )
        self.step_outcomes = Counter(
            "spade_sandbox_step_outcomes", "Session reset/step outcomes.", ["outcome"], registry=self.registry
        )
        self.sessions_open = Gauge("spade_sandbox_sessions_open", "Live sessions.", registry=self.registry)
        self.sessions_reaped = Counter(
            "spade_sandbox_sessions_reaped", "Sessions closed after their idle TTL.", registry=self.registry
        )
        self.latency = Histogram(
            "spade_sandbox_latency_seconds",
            "Latency by operation.",
            ["op"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
