"""Options of every gRPC client channel: balance over all the servers a name resolves to.

In Kubernetes the sandbox and memory Services are headless, so their DNS name resolves to every
ready pod; with gRPC's default ``pick_first`` a client would pin all its calls to one of them.
``round_robin`` keeps a connection to each address and spreads calls over them, and re-resolving
the name at most every ten seconds (when a connection drops or a server ages it out) picks up pods
that came and went. With a name that resolves to one address (compose, a laptop) nothing changes.

>>> dict(client_options())["grpc.service_config"]
'{"loadBalancingConfig": [{"round_robin": {}}]}'
"""

from __future__ import annotations

import json
from typing import Any

ROUND_ROBIN = ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))
RESOLVE_EVERY_MS = ("grpc.dns_min_time_between_resolutions_ms", 10_000)


def client_options(*extra: tuple[str, Any]) -> list[tuple[str, Any]]:
    """Round-robin balancing plus ``extra`` channel options (message sizes, ...)."""
    return [ROUND_ROBIN, RESOLVE_EVERY_MS, *extra]
