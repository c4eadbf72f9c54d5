"""Inference workers found from a Kubernetes Service's EndpointSlices, followed as they change.

In a cluster the inference workers (SGLang pods) come and go: a StatefulSet scaled up, a pod
restarted on another node. Rather than a static list of URLs in three services' configuration,
the learner's weight publisher and the designer's and rollout's clients follow the EndpointSlices
of the inference Service (``kubernetes.io/service-name=<service>``) with the ``kubernetes`` client:
one list, then a watch from its resource version, and a fresh list (a resync) whenever the watch
ends — after ``resync_s``, on a dropped connection, or on ``410 Gone`` — so a missed event is
repaired within one resync. Only endpoints whose ``ready`` condition is not false count.

Outside a cluster nothing here runs: the services use their static ``inference_urls``.

    async with following(settings.inference_discovery, client.set_urls):
        ...  # client.set_urls is called on this loop whenever the ready workers change
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from spade.retry import RetryPolicy
from spade.serving.logs import get_logger

logger = get_logger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class InferenceDiscovery(BaseModel):
    """Where the inference workers are announced: a Service's EndpointSlices in one namespace."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field(default="spade", min_length=1, max_length=63, description="Namespace of the Service.")
    service: str = Field(default="inference", min_length=1, max_length=63, description="The inference Service.")
    port_name: str = Field(default="http", min_length=1, max_length=15, description="Name of the HTTP port.")
    scheme: str = Field(default="http", pattern="^https?$", description="URL scheme of the workers.")
    resync_s: int = Field(
        default=300, ge=5, le=86_400, description="A watch lasts this long, then the slices are listed afresh."
    )
    retry: RetryPolicy = Field(
        default=RetryPolicy(attempts=1000, initial_s=1.0, max_s=30.0),
        description="Back-off between failed lists (the API server unreachable or refusing).",
    )


def _get(obj: Any, name: str) -> Any:
    """A field of an API object, whether the client deserialised it or left it a dict."""
    if isinstance(obj, dict):
        camel = "".join(p.capitalize() if i else p for i, p in enumerate(name.split("_")))
        return obj.get(name, obj.get(camel))
    return getattr(obj, name, None)


def slice_urls(endpoint_slice: Any, port_name: str, scheme: str = "http") -> set[str]:
    """The URLs of the ready endpoints of one EndpointSlice, on its port named ``port_name``."""
    port = next((_get(p, "port") for p in _get(endpoint_slice, "ports") or [] if _get(p, "name") == port_name), None)
    if port is None:
        return set()
    urls = set()
    for endpoint in _get(endpoint_slice, "endpoints") or []:
        conditions = _get(endpoint, "conditions")
        if conditions is not None and _get(conditions, "ready") is False:
            continue
        for address in _get(endpoint, "addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.add(f"{scheme}://{host}:{port}")
    return urls


class EndpointSliceDiscovery:
    """Follows one Service's EndpointSlices and reports the set of ready worker URLs.

    Args:
        config: Which Service, which port, how often to resync.
        api_client: A ``kubernetes.client.ApiClient``; default: the in-cluster configuration (the
            pod's service account, which needs get/list/watch on endpointslices).
    """

    def __init__(self, config: InferenceDiscovery, api_client: Any = None) -> None:
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        if api_client is None:
            k8s_config.load_incluster_config()
            api_client = k8s.ApiClient()
        self.config = config
        self._api = k8s.DiscoveryV1Api(api_client)
        self._slices: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    @property
    def selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.config.service}"

    def urls(self) -> list[str]:
        """The ready workers' URLs known now, sorted."""
        with self._lock:
            return sorted(set().union(*self._slices.values())) if self._slices else []

    def resync(self) -> str:
        """List the slices afresh (replacing what was known); returns the list's resource version."""
        listing: Any = self._api.list_namespaced_endpoint_slice(self.config.namespace, label_selector=self.selector)
        with self._lock:
            self._slices = {
                str(item.metadata.name): slice_urls(item, self.config.port_name, self.config.scheme)
                for item in listing.items
            }
        return str(listing.metadata.resource_version)

    def _apply(self, event: dict[str, Any]) -> None:
        obj = event["object"]
        name = _get(_get(obj, "metadata"), "name")
        with self._lock:
            if event["type"] == "DELETED":
                self._slices.pop(name, None)
            elif event["type"] in ("ADDED", "MODIFIED"):
                self._slices[name] = slice_urls(obj, self.config.port_name, self.config.scheme)

    def _watch(self, resource_version: str, on_change: Callable[[list[str]], None], stop: threading.Event) -> None:
        from kubernetes import watch

        watcher = watch.Watch()
        known = self.urls()
        try:
            for event in watcher.stream(
                self._api.list_namespaced_endpoint_slice,
                self.config.namespace,
                label_selector=self.selector,
                resource_version=resource_version,
                timeout_seconds=self.config.resync_s,
                allow_watch_bookmarks=True,
            ):
                if stop.is_set():
                    return
                if event["type"] == "ERROR":  # e.g. 410 Gone: our resource version is too old
                    logger.info("endpointslice watch: %s; listing afresh", _get(event["object"], "message"))
                    return
                self._apply(event)
                now = self.urls()
                if now != known:
                    known = now
                    on_change(now)
        finally:
            watcher.stop()

    def follow(self, on_change: Callable[[list[str]], None], stop: threading.Event) -> None:
        """List, report, watch; on every end of the watch list again. Returns once ``stop`` is set.

        ``on_change`` is called with the sorted URLs after the first list and whenever they change
        (an empty list is reported too: the caller decides to keep its previous workers).
        """
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        reported: list[str] | None = None
        while not stop.is_set():
            try:
                retrying = self.config.retry.retrying(
                    (ApiException, HTTPError, OSError), logger=logger, what="list endpointslices"
                )
                for attempt in retrying:
                    with attempt:
                        version = self.resync()
            except (ApiException, HTTPError, OSError):
                logger.exception("endpointslice discovery gave up listing; keeping %s", reported)
                return
            if self.urls() != reported:
                reported = self.urls()
                on_change(reported)
            try:
                self._watch(version, on_change, stop)
            except (ApiException, HTTPError, OSError) as exc:
                logger.info("endpointslice watch ended (%s); listing afresh", exc)
                stop.wait(self.config.retry.initial_s)  # never a tight loop against a failing API
            reported = self.urls()


@contextlib.asynccontextmanager
async def following(
    config: InferenceDiscovery | None, apply: Callable[[list[str]], None], api_client: Any = None
) -> AsyncIterator[None]:
    """While the block runs, follow the EndpointSlices and ``apply`` every non-empty URL list on this loop.

    ``config`` ``None`` (outside a cluster) does nothing: the static URLs stay. The follower runs in
    a daemon thread (the ``kubernetes`` client is synchronous); it is told to stop on exit and ends at
    its watch's next event or timeout.
    """
    if config is None:
        yield
        return
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    discovery = EndpointSliceDiscovery(config, api_client)

    def on_change(urls: list[str]) -> None:
        if urls:
            logger.info("inference workers: %s", urls)
            loop.call_soon_threadsafe(apply, urls)
        else:
            logger.warning("the inference Service has no ready endpoint; keeping the current workers")

    thread = threading.Thread(target=discovery.follow, args=(on_change, stop), daemon=True, name="inference-discovery")
    thread.start()
    try:
        yield
    finally:
        stop.set()
