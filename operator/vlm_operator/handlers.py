"""kopf registrations: thin; every handler hands off to the Reconciler."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging

import kopf
from kubernetes.client.exceptions import ApiException

from vlm_operator.api import names
from vlm_operator.api.names import LOG_MARK
from vlm_operator.k8s.pods import vlmd_name
from vlm_operator.k8s.views import Pod
from vlm_operator.metrics import RECONCILES

MANAGED = {"app.kubernetes.io/managed-by": "vlm-operator"}
log = logging.getLogger(__name__)


def _mine(memo: kopf.Memo, namespace: str, name: str, **_) -> bool:
    """A VLMDeployment of this process's shard (runtime/sharding.py; every one when unsharded)."""
    return memo.shard.owns(namespace, name)


def _owner_mine(memo: kopf.Memo, body: kopf.Body, namespace: str, **_) -> bool:
    """A child or pod whose VLMDeployment is of this process's shard."""
    return memo.shard.owns(namespace, vlmd_name(body))


def reconcile(memo: kopf.Memo, namespace: str, name: str, *, retry: bool) -> None:
    """One reconcile; API errors become kopf retries (`retry`) or a log line, never a crash;
    any other exception is logged and counted, and never escapes into the caller's loop over
    VLMDeployments (runtime/periodic.py's resync)."""
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
    except Exception as exc:  # a resource no reconcile can read: the same again on a retry
        RECONCILES.labels(result="error").inc()
        log.exception("reconcile of %s/%s failed", namespace, name)
        if retry:
            raise kopf.PermanentError(f"reconcile failed: {type(exc).__name__}") from exc
    else:
        RECONCILES.labels(result="ok").inc()


@kopf.on.resume(names.GROUP, names.VERSION, names.PLURAL, when=_mine)
@kopf.on.create(names.GROUP, names.VERSION, names.PLURAL, when=_mine)
@kopf.on.update(names.GROUP, names.VERSION, names.PLURAL, when=_mine)
def vlmd_changed(namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    reconcile(memo, namespace, name, retry=True)
    memo.logwatch.spec_changed(namespace, name)


@kopf.on.event(names.GROUP, names.VERSION, names.PLURAL, when=_mine)
async def vlmd_seen(event: dict, memo: kopf.Memo, **_) -> None:
    """Keep runtime/periodic.py's view current: it runs autoscaling rounds and the resync in
    threads of its own, because kopf timers and daemons would put a finalizer on every
    VLMDeployment."""
    obj = event.get("object") or {}
    meta = obj.get("metadata") or {}
    if not meta.get("name"):
        return
    if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
        memo.periodic.untrack(meta["namespace"], meta["name"])
    else:
        memo.periodic.track(obj)


@kopf.on.event("", "v1", "pods", labels=MANAGED, when=_owner_mine)
async def pod_logs(event: dict, memo: kopf.Memo, **_) -> None:
    """Start/stop following the pod's vLLM log (logs/watcher.py); never raises. Async and
    registered before child_changed, so log following never waits for executor slots taken
    by reconciles (kopf runs one event's handlers in order)."""
    pod = event.get("object") or {}
    if not pod.get("metadata", {}).get("uid"):
        return
    try:
        await asyncio.to_thread(memo.logwatch.observe, pod, event.get("type") == "DELETED")
    except Exception:  # a pod event must never break kopf's processing
        log.exception("log watch of pod %s failed", Pod(pod).name)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED, when=_owner_mine)
@kopf.on.event("", "v1", "services", labels=MANAGED, when=_owner_mine)
@kopf.on.event("policy", "poddisruptionbudgets", labels=MANAGED, when=_owner_mine)
@kopf.on.event("", "v1", "persistentvolumeclaims", labels=MANAGED, when=_owner_mine)
@kopf.on.event("", "v1", "pods", labels=MANAGED, when=_owner_mine)
def child_changed(body: kopf.Body, namespace: str, memo: kopf.Memo, event: dict, **_) -> None:
    """A child changed or vanished: restore drift and refresh its VLMDeployment's status."""
    vlmd = vlmd_name(body)
    if vlmd and _news(memo.seen, event):
        reconcile(memo, namespace, vlmd, retry=False)


def _news(seen: dict[str, tuple[str, bytes, str | None]], event: dict) -> bool:
    """Whether an event says something not seen yet. kopf lists afresh whenever it reopens a
    watch (every 5 minutes, and after 70 s without events where the apiserver sends no
    bookmarks) and hands every listed object over again: with 200 VLMDeployments that was
    some 8 reconciles/s of nothing (bench/results/scale.md). A new version that only moved a
    pod's log resume mark (names.LOG_MARK, written by the operator itself every few
    minutes) is no news either. `seen`: uid -> (resourceVersion, digest of the rest, mark)."""
    obj = event.get("object") or {}
    meta = obj.get("metadata") or {}
    uid, version = meta.get("uid"), meta.get("resourceVersion")
    if event.get("type") == "DELETED":
        seen.pop(uid, None)
        return True
    if not uid or not version:
        return True
    old = seen.get(uid)
    if old is not None and old[0] == version:
        return False
    digest, mark = _digest(obj), (meta.get("annotations") or {}).get(LOG_MARK)
    seen[uid] = (version, digest, mark)
    return old is None or old[1] != digest or old[2] == mark


def _digest(obj: dict) -> bytes:
    """The object less what changes without news: its version, managedFields, the log mark."""
    meta = dict(obj.get("metadata") or {})
    meta.pop("resourceVersion", None)
    meta.pop("managedFields", None)
    annotations = meta.get("annotations")
    if isinstance(annotations, dict) and LOG_MARK in annotations:
        meta["annotations"] = {k: v for k, v in annotations.items() if k != LOG_MARK}
    text = json.dumps({**obj, "metadata": meta}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()

