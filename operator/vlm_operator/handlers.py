"""kopf registrations: thin; every handler hands off to the Reconciler."""

from __future__ import annotations

import asyncio
import logging

import kopf
from kubernetes.client.exceptions import ApiException

from vlm_operator import crd
from vlm_operator.autoscaler import is_builtin
from vlm_operator.metrics import RECONCILES
from vlm_operator.reconciler import owner_name

MANAGED = {"app.kubernetes.io/managed-by": "vlm-operator"}
RESYNC_SECONDS = 300  # a safety net: child and pod events drive the real work
AUTOSCALE_SECONDS = 1.0
log = logging.getLogger(__name__)


def _reconcile(memo: kopf.Memo, namespace: str, name: str, *, retry: bool) -> None:
    try:
        memo.reconciler.reconcile(namespace, name)
    except ApiException as exc:
        if exc.status == 404:  # deleted while we looked at it: nothing left to do
            return
        RECONCILES.labels(result="error").inc()
        if retry and (exc.status is None or exc.status >= 500 or exc.status in (409, 429)):
            raise kopf.TemporaryError(f"API error {exc.status}: {exc.reason}", delay=5) from exc
        log.warning("reconcile of %s/%s failed: %s %s", namespace, name, exc.status, exc.reason)
        if retry:
            raise kopf.PermanentError(f"API error {exc.status}: {exc.reason}") from exc
    else:
        RECONCILES.labels(result="ok").inc()


@kopf.on.resume(crd.GROUP, crd.VERSION, crd.PLURAL)
@kopf.on.create(crd.GROUP, crd.VERSION, crd.PLURAL)
@kopf.on.update(crd.GROUP, crd.VERSION, crd.PLURAL)
def vlmd_changed(namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    _reconcile(memo, namespace, name, retry=True)
    memo.logwatch.spec_changed(namespace, name)


@kopf.timer(crd.GROUP, crd.VERSION, crd.PLURAL, interval=RESYNC_SECONDS, idle=RESYNC_SECONDS)
def vlmd_resync(namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    _reconcile(memo, namespace, name, retry=False)


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, when=lambda spec, **_: is_builtin(spec),
             cancellation_timeout=10)
async def vlmd_autoscale(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                         stopped: kopf.DaemonStopped, **_) -> None:
    """Builtin autoscaling: one round every AUTOSCALE_SECONDS while the mode is Builtin.

    A daemon, not a timer: kopf logs every timer run. Rounds run in a thread (blocking HTTP);
    a failed round is logged and the next one tries again.
    """
    while not stopped:
        try:
            await asyncio.to_thread(memo.autoscaler.tick, body)
        except Exception:
            log.exception("autoscaling round of %s/%s failed", namespace, name)
        await stopped.wait(AUTOSCALE_SECONDS)
    memo.autoscaler.forget(namespace, name)


@kopf.on.event("", "v1", "pods", labels=MANAGED)
async def pod_logs(event: dict, memo: kopf.Memo, **_) -> None:
    """Start/stop following the pod's vLLM log (logwatch.py); never raises. Async and
    registered before child_changed, so log following never waits for executor slots taken
    by reconciles (kopf runs one event's handlers in order)."""
    pod = event.get("object") or {}
    if not pod.get("metadata", {}).get("uid"):
        return
    try:
        await asyncio.to_thread(memo.logwatch.observe, pod, event.get("type") == "DELETED")
    except Exception:  # a pod event must never break kopf's processing
        log.exception("log watch of pod %s failed", pod["metadata"].get("name"))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("policy", "poddisruptionbudgets", labels=MANAGED)
@kopf.on.event("", "v1", "persistentvolumeclaims", labels=MANAGED)
@kopf.on.event("", "v1", "pods", labels=MANAGED)
def child_changed(body: kopf.Body, namespace: str, memo: kopf.Memo, **_) -> None:
    """A child changed or vanished: restore drift and refresh the owner's status."""
    owner = owner_name(body)
    if owner:
        _reconcile(memo, namespace, owner, retry=False)

