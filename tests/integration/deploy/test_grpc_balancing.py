"""gRPC clients balance over every address a name resolves to (headless Services in Kubernetes)."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from spade.grpc_channels import client_options


class CountingHealth(health.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 (the proto's method name)
        self.calls += 1
        return super().Check(request, context)


def _calls(options: list[tuple[str, Any]] | None, most: int) -> list[int]:
    """Calls each of two servers got, from one channel to both, stopping once both got some."""
    from concurrent import futures

    servicers, servers, ports = [], [], []
    for _ in range(2):
        servicer = CountingHealth()
        server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servicers.append(servicer)
        servers.append(server)
    try:
        # One name, two addresses: what DNS gives for a headless Service with two ready pods.
        target = f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
        with grpc.insecure_channel(target, options=options or []) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(most):
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True)
                if all(s.calls for s in servicers):
                    break
        return [s.calls for s in servicers]
    finally:
        for server in servers:
            server.stop(None)


def test_round_robin_spreads_calls_over_every_address() -> None:
    # Round robin uses a server as soon as its connection is up (the second may connect a little
    # after the first): both get calls well within the bound.
    assert all(_calls(client_options(), most=500))
    assert sorted(_calls(None, most=100)) == [0, 100], "pick_first (gRPC's default) pins one server: the control"
