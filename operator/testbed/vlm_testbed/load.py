"""Steady load through a Service, sent the way a client in the cluster reaches it.

In a cluster a client's request to a Service goes where kube-proxy sends it: to one of the ready
endpoints of the Service's EndpointSlices, as kube-proxy last synced them. The test bed has no
kube-proxy (pods are loopback addresses on one machine), so LoadClient plays it: it follows the
Service's EndpointSlices with a watch (discovery.k8s.io/v1 where served, v1beta1 on 1.20),
takes an endpoint as ready unless its `ready` condition says false (the API's rule), applies
changes at most once per SYNC_S (kube-proxy's iptables minimum sync period, 1 s by default), and
spreads requests over the ready endpoints in turn.

Every request it starts is counted once: answered (HTTP 200) or failed, and why (no ready
endpoint, as kube-proxy then rejects the connection; refused; reset; timeout; an HTTP status).
A request still in flight when the load stops is waited for, so nothing goes uncounted.

    with LoadClient.for_service(api, namespace, "my-vlmd", rate=20) as load:
        ...  # a Replace, a ScaleDown, a node drain
    load.result()  # {"started": ..., "answered": ..., "failed": ..., "why": {...}}
"""

from __future__ import annotations

import collections
import http.client
import itertools
import json
import threading
import time
from collections import Counter
from typing import Any

from vlm_operator.k8s.informer import Informer, Stale
from vlm_operator.k8s.kube import Kube

SYNC_S = 1.0
MAX_RECORDS = 200_000  # per-request records kept (about an hour at 50 requests a second)
SLICE_GROUP = "discovery.k8s.io"
SERVICE_LABEL = "kubernetes.io/service-name"


def ready_endpoints(endpoint_slice: dict, port_name: str = "http") -> tuple[str, ...]:
    """`ip:port` of the endpoints of one EndpointSlice that take traffic: `ready` true or
    unset (an unknown condition counts as ready), terminating ones never (v1 marks them not
    ready; 1.20 leaves them out)."""
    ports = [p.get("port") for p in endpoint_slice.get("ports") or []
             if p.get("name", "") == port_name]
    if not ports or ports[0] is None:
        return ()
    out = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        out += [f"{address}:{ports[0]}" for address in endpoint.get("addresses") or []]
    return tuple(sorted(out))


def slice_version(kube: Kube) -> str:
    """discovery.k8s.io/v1 where the apiserver serves it (1.21+), else v1beta1."""
    versions = kube.list_page(f"/apis/{SLICE_GROUP}", []).get("versions", [])
    return "v1" if any(v.get("version") == "v1" for v in versions) else "v1beta1"


class LoadClient:
    """`rate` requests a second, from `concurrency` threads, each a completion of `max_tokens`
    tokens, to the ready endpoints `slices` holds (an Informer of a Service's EndpointSlices
    kept as ready_endpoints: for_service)."""

    def __init__(self, slices: Informer, *, rate: float = 20.0, concurrency: int = 8,
                 max_tokens: int = 1, timeout_s: float = 30.0, sync_s: float = SYNC_S) -> None:
        self.slices = slices
        self.rate, self.concurrency = rate, concurrency
        self.max_tokens, self.timeout_s, self.sync_s = max_tokens, timeout_s, sync_s
        self._lock = threading.Lock()
        self._synced_at = -float("inf")
        self._endpoints: tuple[str, ...] = ()
        self._turn = itertools.count()
        self._tickets = threading.Semaphore(0)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.counts: Counter = Counter()  # answered, and each reason a request failed
        self.by_endpoint: Counter = Counter()
        self.started = 0
        # (wall time sent, endpoint or None, outcome, wall time done) of the last MAX_RECORDS
        self.records: collections.deque = collections.deque(maxlen=MAX_RECORDS)

    @classmethod
    def for_service(cls, api: Any, namespace: str, service: str, **kw) -> LoadClient:
        kube = Kube(api)
        path = (f"/apis/{SLICE_GROUP}/{slice_version(kube)}/namespaces/{namespace}/"
                "endpointslices")
        return cls(Informer(kube, f"endpointslices {namespace}/{service}", path,
                            ready_endpoints, (("labelSelector", f"{SERVICE_LABEL}={service}"),)),
                   **kw)

    # -- kube-proxy's part
    def endpoints(self) -> tuple[str, ...]:
        """The ready endpoints as last synced (at most once per sync_s)."""
        now = time.monotonic()
        with self._lock:
            if now - self._synced_at >= self.sync_s:
                try:
                    self._endpoints = tuple(sorted(
                        e for found in self.slices.values() for e in found))
                    self._synced_at = now
                except Stale:  # kube-proxy keeps its last rules while it cannot sync
                    pass
            return self._endpoints

    def _pick(self) -> str | None:
        endpoints = self.endpoints()
        return endpoints[next(self._turn) % len(endpoints)] if endpoints else None

    # -- the load
    def start(self) -> LoadClient:
        self.slices.start()
        self.endpoints()
        self._threads = [threading.Thread(target=self._ticker, daemon=True, name="load ticker")]
        self._threads += [threading.Thread(target=self._worker, daemon=True, name=f"load {i}")
                          for i in range(self.concurrency)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop starting requests; wait for those in flight (each has its timeout)."""
        self._stop.set()
        for _ in range(self.concurrency):
            self._tickets.release()
        for thread in self._threads:
            thread.join(self.timeout_s + 5)
        self.slices.stop()

    def __enter__(self) -> LoadClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _ticker(self) -> None:
        """A ticket per 1/rate seconds, on a fixed schedule (late tickets are not dropped)."""
        start = time.monotonic()
        for n in itertools.count(1):
            if self._stop.wait(max(0.0, start + n / self.rate - time.monotonic())):
                return
            self._tickets.release()

    def _worker(self) -> None:
        while True:
            self._tickets.acquire()
            if self._stop.is_set():
                return
            endpoint = self._pick()
            sent = time.time()
            with self._lock:
                self.started += 1
            outcome = self._send(endpoint) if endpoint else "no_ready_endpoint"
            with self._lock:
                self.counts[outcome] += 1
                if endpoint:
                    self.by_endpoint[endpoint] += 1
                self.records.append((sent, endpoint, outcome, time.time()))

    def sent_to(self, ip: str, after: float, before: float = float("inf")) -> int:
        """Requests sent to `ip` (any port) from wall time `after` until `before`."""
        with self._lock:
            return sum(1 for sent, endpoint, _, _ in self.records
                       if after <= sent < before and endpoint
                       and endpoint.rsplit(":", 1)[0] == ip)

    def first_answer_after(self, after: float) -> float | None:
        """When the first request sent at or after `after` was answered (wall time)."""
        with self._lock:
            done = [end for sent, _, outcome, end in self.records
                    if sent >= after and outcome == "answered"]
        return min(done) if done else None

    def failed_after(self, after: float) -> int:
        with self._lock:
            return sum(1 for sent, _, outcome, _ in self.records
                       if sent >= after and outcome != "answered")

    def _send(self, endpoint: str) -> str:
        host, port = endpoint.rsplit(":", 1)
        body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": self.max_tokens})
        conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
        try:
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            return "answered" if response.status == 200 else f"http_{response.status}"
        except ConnectionRefusedError:
            return "refused"
        except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
            return "reset"
        except TimeoutError:
            return "timeout"
        except (OSError, http.client.HTTPException) as exc:
            return f"error_{type(exc).__name__}"
        finally:
            conn.close()

    def result(self) -> dict:
        """What happened to every request started so far."""
        with self._lock:
            failed = {k: v for k, v in self.counts.items() if k != "answered"}
            return {"started": self.started, "answered": self.counts["answered"],
                    "failed": sum(failed.values()), "why": dict(sorted(failed.items())),
                    "endpoints_used": len(self.by_endpoint)}
