"""One reconcile pass for a VLMDeployment: plan with the pure functions, then act through Kube.

Every trigger (the resource changed, a child changed or vanished, a pod changed, the periodic
resync) ends here, so drift is restored and status refreshed by the same code path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Sequence

from kubernetes.client.exceptions import ApiException

from vlm_operator.api import admin_policy, crd
from vlm_operator.api.reports import Event, Report
from vlm_operator.api.validation import SpecError, parse, validate
from vlm_operator.autoscaling import recommend as autoscaling
from vlm_operator.autoscaling.autoscaler import put_out_of_service
from vlm_operator.desired import autoscaler_objects, children, inference_pool
from vlm_operator.k8s.kube import Kube, now_iso, priority_value, secret_labels
from vlm_operator.k8s.views import Body
from vlm_operator.reconcile import status
from vlm_operator.remediation import incidents

log = logging.getLogger(__name__)


def _ours(obj: dict, desired: dict) -> tuple:
    """What of `obj` an apply of `desired` writes: the spec fields and the labels and
    annotations it sets (the surge annotation too, which comes and goes), and ownerReferences.
    Another writer's fields (the deployment controller's revision annotation) are left out: a
    change of theirs between our read and our apply is not drift."""
    meta, want = obj["metadata"], desired["metadata"]

    def picked(have: dict | None, keys: set) -> dict:
        return {k: v for k, v in (have or {}).items() if k in keys}

    return (picked(obj.get("spec"), set(desired.get("spec") or {})),
            picked(meta.get("labels"), set(want.get("labels") or {})),
            picked(meta.get("annotations"),
                   {*(want.get("annotations") or {}), children.SURGE_ANNOTATION}),
            meta.get("ownerReferences"))


def _changed(before: dict | None, after: dict, desired: dict) -> bool:
    """Whether our apply changed what it writes (status and resourceVersion churn, and other
    writers' fields, do not count)."""
    return before is None or _ours(before, desired) != _ours(after, desired)


def _surge(child: dict) -> str | None:
    return ((child.get("metadata") or {}).get("annotations") or {}).get(
        children.SURGE_ANNOTATION)


def _status_without_times(st: dict | None) -> dict:
    st = dict(st or {})
    st["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                        for c in st.get("conditions") or []]
    return st


# Other parts of the operator (log watching, autoscaling) contribute conditions through these:
# called with the namespace and name of a VLMDeployment, they return Report items.
ReportProvider = Callable[[str, str], list[Report]]


class Reconciler:
    def __init__(self, kube: Kube, rules: admin_policy.AdminPolicy | None = None, *,
                 report_providers: Sequence[ReportProvider] = (),
                 inference_pools: bool = True):
        """`rules`: the cluster admin's policy (admin_policy.py; None: none);
        `report_providers`: the other parts' conditions, in the order they are published;
        `inference_pools`: whether this installation manages InferencePools (its RBAC grants
        them: --inference-pools)."""
        self.kube = kube
        self.rules = rules
        self.inference_pools = inference_pools
        self.report_providers = tuple(report_providers)
        self._guard = threading.Lock()
        self._running: set[tuple[str, str]] = set()
        self._dirty: set[tuple[str, str]] = set()

    def reconcile(self, namespace: str, name: str) -> None:
        """Bring the children in line with the spec and refresh status.

        Serialised and coalesced per object: a call while a pass runs marks the object dirty and
        returns; the running pass goes round once more. A burst of pod events thus costs at most
        two passes, not one per event.
        """
        key = (namespace, name)
        with self._guard:
            if key in self._running:
                self._dirty.add(key)
                return
            self._running.add(key)
        try:
            while True:
                with self._guard:
                    self._dirty.discard(key)
                body = self.kube.get_vlmd(namespace, name)
                if body is not None and not Body(body).deleting:
                    self._reconcile(body)
                with self._guard:  # checked and released together: no request slips between
                    if key not in self._dirty:
                        self._running.discard(key)
                        return
        except BaseException:
            with self._guard:
                self._running.discard(key)
                self._dirty.discard(key)
            raise

    def refresh(self, namespace: str, name: str) -> None:
        """reconcile after an action elsewhere (a remediation, an autoscaling condition) to
        publish its status; errors are only logged: the next event or resync retries."""
        try:
            self.reconcile(namespace, name)
        except Exception as exc:
            log.info("status refresh of %s/%s: %s", namespace, name, exc)

    def _reconcile(self, body: dict) -> None:
        meta = Body(body)
        namespace, name, generation = meta.namespace, meta.name, meta.generation
        old_status = body.get("status") or {}
        first_look = old_status.get("observedGeneration") != generation
        problems, warnings = validate(
            body, self.rules,
            lambda secret: secret_labels(self.kube.api, namespace, secret),
            lambda priority_class: priority_value(self.kube.api, priority_class))
        vlmd = None
        if not problems:
            try:
                vlmd = parse(body)
            except SpecError as exc:  # validate and parse agree; kept for safety of the loop
                problems = exc.problems
        failures: list[ApiException] = []
        foreign: list[str] = []
        gateway: list[Report] = []
        if vlmd is not None:
            failures, foreign, gateway = self._apply_children(body, vlmd, drift=not first_look)
            if first_look:
                for warning in warnings:
                    self.kube.post_event(body, Event("Warning", "SpecWarning", warning))
        deployment = self.kube.get("apps/v1", "Deployment", namespace, name)
        if deployment is not None and not children.is_controlled_by(deployment, meta.uid):
            deployment = None  # another app's: its rollout says nothing about ours
        pods = self.kube.list_pods(namespace, children.get_selector(name))
        if vlmd is not None:
            self._put_back_stale_drains(body, vlmd, pods)
        reports = [*gateway,
                   *(r for provider in self.report_providers for r in provider(namespace, name))]
        if failures:
            reports.append(Report("Degraded", "True", "ApplyFailed", "; ".join(
                _failure_text(exc) for exc in failures)))
        if foreign:
            reports.append(Report("Degraded", "True", "ObjectNotOwned", (
                f"{', '.join(foreign)} already exist{'s' if len(foreign) == 1 else ''} and "
                f"{'is' if len(foreign) == 1 else 'are'} not controlled by this VLMDeployment: "
                "the operator leaves them untouched; delete or rename them, or give the "
                "VLMDeployment another name")))
        new_status = status.get_status(
            name=name, generation=generation, old=old_status, vlmd=vlmd, problems=problems,
            deployment=deployment, pods=pods, now=now_iso(), reports=reports,
            surge=incidents.surge(meta.annotations))
        if _status_without_times(new_status) != _status_without_times(
                {k: old_status.get(k) for k in new_status}):
            self.kube.patch_vlmd_status(namespace, name, new_status)
        for event in status.get_events(old_status, new_status):
            self.kube.post_event(body, event)
        retry = [exc for exc in failures if exc.status is None or exc.status >= 500
                 or exc.status in (409, 429)]
        if retry:  # status says what failed; the caller retries these
            raise retry[0]

    def _apply_children(self, body: dict, vlmd, drift: bool
                        ) -> tuple[list[ApiException], list[str], list[Report]]:
        """Apply every child; one that fails (RBAC, admission, a bad field) does not stop the
        others. An object of a child's name that this VLMDeployment does not control (another
        app's Service, a PVC made by hand) is never written: a forced apply would take it over
        and the garbage collector would delete it with the VLMDeployment. Returns the failures,
        the objects left alone ("Kind name") and what the gateway's objects report, for
        status."""
        hpa_version = self.kube.hpa_api_version
        keda = self.kube.keda_served()
        failures: list[ApiException] = []
        foreign: list[str] = []
        try:
            served = inference_pool.asks_cluster(vlmd, self.inference_pools, drift) and \
                self.kube.inference_pools_served()
            pools, gateway = inference_pool.get_pool_plan(vlmd, self.inference_pools, served)
        except ApiException as exc:  # discovery failed: unknown, so neither written nor missing
            exc.child = f"{inference_pool.KIND} {vlmd.name}"
            failures.append(exc)
            pools, gateway = False, []
        if not drift:  # a new spec may no longer want an autoscaler or a pool an older one made
            self._delete_unwanted(body, vlmd, hpa_version, keda, pools)
        surge = incidents.surge(Body(body).annotations)
        address = admin_policy.prometheus_address(vlmd.spec,
                                                  self.rules or admin_policy.AdminPolicy())
        for child in [*children.get_children(vlmd, self.kube.pdb_api_version, hpa_version, keda,
                                             surge, address,
                                             self.kube.pdb_unhealthy_pod_eviction),
                      *inference_pool.get_gateway_children(vlmd, pools)]:
            kind, child_name = child["kind"], Body(child).name
            try:
                before = self.kube.get(child["apiVersion"], kind, vlmd.namespace, child_name)
                if not children.may_write(before, vlmd.uid):
                    foreign.append(f"{kind} {child_name}")
                    continue
                desired = children.keep_selector(child, before)
                after = self.kube.apply(desired)
            except ApiException as exc:
                exc.child = f"{kind} {child_name}"
                log.warning("%s/%s: applying %s failed: %s %s", vlmd.namespace, vlmd.name,
                            exc.child, exc.status, exc.reason)
                failures.append(exc)
                continue
            if not _changed(before, after, desired):
                continue
            if before is None:
                reason, verb = ("DriftRestored", "Recreated") if drift else ("Created", "Created")
            else:
                reason, verb = ("DriftRestored", "Restored") if drift else ("Updated", "Updated")
            message = f"{verb} {kind} {child_name}"
            if before is not None and _surge(before) != _surge(after):
                reason = "Updated"  # a replacement began or ended: ours, not drift
                message = (f"Updated {kind} {child_name}: replicas {before['spec']['replicas']}"
                           f" -> {after['spec']['replicas']} "
                           + ("while a replacement for a sick pod comes up" if _surge(after)
                              else "(replacement done)"))
            log.info("%s/%s: %s", vlmd.namespace, vlmd.name, message)
            self.kube.post_event(body, Event("Normal", reason, message))
        if foreign:
            log.warning("%s/%s: not ours, left untouched: %s", vlmd.namespace, vlmd.name,
                        ", ".join(foreign))
        return failures, foreign, gateway

    def _put_back_stale_drains(self, body: dict, vlmd, pods: list[dict]) -> None:
        """Pods the Builtin autoscaler took out of the Service when it is no longer on: nothing
        else would ever finish those drains."""
        builtin = crd.autoscaling_mode(vlmd.spec) == "Builtin"
        for pod in autoscaling.stale_drains(pods, builtin):
            put_out_of_service(self.kube, vlmd.namespace, pod, None)
            self.kube.post_event(body, Event(
                "Normal", "DrainCancelled", f"put {pod} back into the Service: Builtin "
                "autoscaling, which was draining it, is off"))

    def _delete_unwanted(self, body: dict, vlmd, hpa_version: str, keda: bool,
                         pools: bool) -> None:
        """Delete the HPA, ScaledObject or InferencePool this VLMDeployment made and no longer
        wants; one of the same name that is not ours (another controller's, a user's) stays.
        `pools`: see inference_pool.get_pool_plan."""
        served = (self.rules or admin_policy.AdminPolicy()).autoscaling_modes
        pool = inference_pool.unwanted_pool(vlmd) if pools else None
        for api_version, kind, child_name in [*autoscaler_objects.get_unwanted(
                vlmd, hpa_version, keda, served), *([pool] if pool else [])]:
            obj = self.kube.get(api_version, kind, vlmd.namespace, child_name)
            if obj is None or not children.is_controlled_by(obj, vlmd.uid):
                continue
            if self.kube.delete(api_version, kind, vlmd.namespace, child_name,
                                uid=Body(obj).uid):
                self.kube.post_event(body, Event("Normal", "Deleted",
                                                        f"Deleted {kind} {child_name}"))


def _failure_text(exc: ApiException) -> str:
    """`Kind name: 403 Forbidden: <the apiserver's message>`."""
    detail = ""
    with contextlib.suppress(ValueError, AttributeError):
        detail = json.loads(exc.body or "{}").get("message", "")
    text = f"{getattr(exc, 'child', 'a child')}: {exc.status} {exc.reason}"
    return f"{text}: {detail[:300]}" if detail else text

