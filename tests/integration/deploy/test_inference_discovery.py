"""Inference discovery against a local HTTP server that speaks the Kubernetes API's list and watch of
EndpointSlices (chunked JSON event stream, resource versions, 410 Gone), as the real API server
does; the real ``kubernetes`` client talks to it. No cluster runs here."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from spade.inference.discovery import EndpointSliceDiscovery, InferenceDiscovery, slice_urls

PATH = "/apis/discovery.k8s.io/v1/namespaces/spade/endpointslices"


def _slice(name: str, ready: list[str], not_ready: tuple[str, ...] = (), port: int = 30000) -> dict[str, Any]:
    endpoints = [{"addresses": [a], "conditions": {"ready": True}} for a in ready]
    endpoints += [{"addresses": [a], "conditions": {"ready": False}} for a in not_ready]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "spade", "labels": {"kubernetes.io/service-name": "inference"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


class FakeApiServer:
    """List returns the current slices at a resource version; watch streams queued events."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.lists = 0
        self.expired_below = 0
        self.watches: list[dict[str, list[str]]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                assert url.path == PATH, url.path
                assert query["labelSelector"] == ["kubernetes.io/service-name=inference"], query
                if query.get("watch", ["false"])[0].lower() == "true":
                    server.watches.append(query)
                    self._watch(int(query.get("resourceVersion", ["0"])[0]))
                else:
                    server.lists += 1
                    body = json.dumps(
                        {
                            "apiVersion": "discovery.k8s.io/v1",
                            "kind": "EndpointSliceList",
                            "metadata": {"resourceVersion": str(server.version)},
                            "items": list(server.slices.values()),
                        }
                    ).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def _send(self, event: dict[str, Any]) -> None:
                line = (json.dumps(event) + "\n").encode()
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()

            def _watch(self, version: int) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if version < server.expired_below:  # compacted away: the API answers 410 Gone
                    self._send(server.gone())
                else:
                    while True:
                        event = server.events.get()
                        if event is None:  # the server ends this watch (as at timeoutSeconds)
                            break
                        self._send(event)
                        if event["type"] == "ERROR":
                            break
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def change(self, kind: str, obj: dict[str, Any]) -> None:
        """Change the state and stream the event, as the API server does."""
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        else:
            self.slices[obj["metadata"]["name"]] = obj
        self.events.put({"type": kind, "object": obj})

    @staticmethod
    def gone() -> dict[str, Any]:
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": "too old resource version", "reason": "Expired", "code": 410}  # fmt: skip
        return {"type": "ERROR", "object": status}

    def expire(self) -> None:
        """Compact history: watches from any version seen so far now get 410 Gone."""
        self.expired_below = self.version
        self.events.put(self.gone())

    def close(self) -> None:
        self.events.put(None)
        self.httpd.shutdown()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


def _discovery(api: FakeApiServer) -> EndpointSliceDiscovery:
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = api.url
    return EndpointSliceDiscovery(InferenceDiscovery(namespace="spade", resync_s=60), client.ApiClient(configuration))


def test_slice_urls_keeps_ready_endpoints_on_the_named_port() -> None:
    urls = slice_urls(_slice("a", ["10.0.0.1", "10.0.0.2"], ("10.0.0.3",)), "http")
    assert urls == {"http://10.0.0.1:30000", "http://10.0.0.2:30000"}
    assert slice_urls(_slice("a", ["10.0.0.1"]), "grpc") == set()
    assert slice_urls(_slice("a", ["fd00::1"]), "http") == {"http://[fd00::1]:30000"}


@pytest.mark.slow
def test_follow_lists_then_watches_and_resyncs_after_gone(api: FakeApiServer) -> None:
    api.slices["inference-a"] = _slice("inference-a", ["10.0.0.1"], ("10.0.0.9",))
    reports: queue.Queue[list[str]] = queue.Queue()
    stop = threading.Event()
    discovery = _discovery(api)
    follower = threading.Thread(target=discovery.follow, args=(reports.put, stop), daemon=True)
    follower.start()
    try:
        assert reports.get(timeout=30) == ["http://10.0.0.1:30000"]
        # The StatefulSet scales up: the slice gains a ready endpoint.
        api.change("MODIFIED", _slice("inference-a", ["10.0.0.1", "10.0.0.2"]))
        assert reports.get(timeout=30) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
        # A second slice appears, the first is deleted.
        api.change("ADDED", _slice("inference-b", ["10.0.1.1"]))
        assert reports.get(timeout=30) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.1.1:30000"]
        api.change("DELETED", _slice("inference-a", []))
        assert reports.get(timeout=30) == ["http://10.0.1.1:30000"]
        # Events missed while the watch was down are repaired by the next list: the API answers
        # 410 Gone, the follower lists afresh and reports the state it finds.
        api.slices["inference-c"] = _slice("inference-c", ["10.0.2.1"])
        lists = api.lists
        api.expire()
        assert reports.get(timeout=30) == ["http://10.0.1.1:30000", "http://10.0.2.1:30000"]
        assert api.lists == lists + 1
        # Every watch started from the resource version of the list before it.
        assert all(w.get("resourceVersion") for w in api.watches)
    finally:
        stop.set()
        api.events.put(None)
        follower.join(30)
    assert not follower.is_alive()


@pytest.mark.slow
def test_clients_and_the_publisher_follow_the_slices(api: FakeApiServer, tmp_path: Any) -> None:
    import asyncio

    from kubernetes import client

    from services.learner.publisher import WeightPublisher
    from spade.inference.client import InferenceClient
    from spade.inference.discovery import following
    from spade.queues.inprocess import InProcessQueue

    api.slices["inference-a"] = _slice("inference-a", ["10.0.0.1", "10.0.0.2"])
    configuration = client.Configuration()
    configuration.host = api.url

    async def run() -> tuple[list[str], list[str], list[str]]:
        inference = InferenceClient(["http://inference-0.inference:30000"])
        publisher = WeightPublisher(["http://inference-0.inference:30000"], InProcessQueue(), weights_dir=tmp_path)
        config = InferenceDiscovery(namespace="spade", resync_s=60)

        def apply(urls: list[str]) -> None:
            inference.set_urls(urls)
            publisher.set_workers(urls)

        async with following(config, apply, client.ApiClient(configuration)):
            for _ in range(600):
                if inference.urls != ["http://inference-0.inference:30000"]:
                    break
                await asyncio.sleep(0.05)
            first = inference.urls
            api.change("MODIFIED", _slice("inference-a", ["10.0.0.2", "10.0.0.3"]))
            for _ in range(600):
                if inference.urls != first:
                    break
                await asyncio.sleep(0.05)
            second = inference.urls
        workers = sorted(publisher._clients)
        await inference.aclose()
        await publisher.close()
        return first, second, workers

    first, second, workers = asyncio.run(run())
    assert first == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert second == ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
    assert workers == second
