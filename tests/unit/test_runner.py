"""runner.configure: kopf's own requests have deadlines, and its retries never run out (its
default list ends the watch streams, and with them the operator, after a minute of outage).
runner.build: every object is wired to the others when it is made, the Reconciler last with
every report provider, and the status refreshes of the others reach it."""

import argparse
import itertools
import logging

import kopf
import pytest
from kubernetes import client

from vlm_operator import runner
from vlm_operator.cli import build_parser


def test_kopf_requests_have_deadlines_and_retry_for_as_long_as_it_takes():
    settings = kopf.OperatorSettings()
    args = argparse.Namespace(peering="vlm-operator", priority=0, standalone=True,
                              namespaces=[], shards=1, shard="0")
    runner.configure(settings, args)
    assert settings.networking.request_timeout == runner.KOPF_REQUEST_TIMEOUT_S
    assert settings.networking.connect_timeout and settings.watching.connect_timeout
    waits = list(itertools.islice(settings.networking.error_backoffs, 1000))
    assert len(waits) == 1000 and sum(waits) > 3600
    assert not hasattr(settings.networking.error_backoffs, "__len__")  # kopf counts no end
    assert list(itertools.islice(settings.networking.error_backoffs, 3)) == [1, 1, 2]


def test_shards_have_peerings_of_their_own(monkeypatch):
    args = argparse.Namespace(peering="vlm-operator", priority=0, standalone=False,
                              namespaces=[], shards=4, shard="auto")
    monkeypatch.setenv("POD_NAME", "vlm-operator-2")
    settings = kopf.OperatorSettings()
    runner.configure(settings, args)
    assert settings.peering.name == "vlm-operator-2"
    monkeypatch.setenv("POD_NAME", "vlm-operator-7")
    try:
        runner.get_shard(args)
    except SystemExit as exc:
        assert "0..3" in str(exc)
    else:
        raise AssertionError("shard 7 of 4 accepted")


def test_only_urllib3_pool_full_warnings_are_dropped():
    def record(msg, *args):
        return logging.LogRecord("urllib3.connectionpool", logging.WARNING, "", 0, msg, args,
                                 None)
    assert not runner._not_pool_full(record(
        "Connection pool is full, discarding connection: %s. Connection pool size: %s",
        "127.0.0.1", 64))
    assert runner._not_pool_full(record("Retrying (%s) after connection broken", "Retry(1)"))


@pytest.fixture
def parts(request):
    """runner.build's objects for `vlm-operator run` with the flags the test is parametrised
    with, on an API client nothing answers (building calls no API); stopped afterwards."""
    args = build_parser().parse_args(["run", *getattr(request, "param", ["--standalone"])])
    built = runner.build(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")),
                         args, shard=runner.get_shard(args), identity="test",
                         peering_name=args.peering, resync=lambda ns, name: None)
    yield built
    built.logwatch.stop()
    built.scraper.stop()
    built.cluster.stop()


def test_every_part_is_wired_to_the_others_when_built(parts):
    remediator = parts.remediator
    kube = parts.reconciler.kube
    assert parts.cluster.kube is kube and parts.autoscaler.kube is kube
    assert parts.logwatch.kube is kube and remediator.kube is kube
    # the GPU budget, read by the autoscaler's scale-ups and by surge replacements
    assert parts.budget.cluster is parts.cluster and parts.autoscaler.budget is parts.budget
    assert remediator.replica_fits == parts.budget.replica_fits
    assert remediator.leaving_nodes == parts.cluster.leaving_nodes
    # what a pod's current container logged: asked of the registry log watching fills
    assert parts.logwatch.remediator is remediator
    assert remediator.engine_dead == parts.logwatch.followers.engine_dead
    assert remediator.recovery.plugin_loaded == parts.logwatch.followers.plugin_loaded
    # log watching's findings: what the autoscaler removes first; its heartbeats: stall
    # detection's; its Remediator: the one stall detection and the rounds hand incidents to
    assert parts.autoscaler.failing_pods == parts.logwatch.failing_pods
    assert parts.logwatch.heartbeats is parts.stall_watch.heartbeats
    assert parts.stall_watch.remediator is remediator and parts.rounds.remediator is remediator
    assert (parts.rounds.cluster, parts.rounds.scraper, parts.rounds.stall_watch,
            parts.rounds.autoscaler, parts.rounds.reads) == (
        parts.cluster, parts.scraper, parts.stall_watch, parts.autoscaler, parts.reads)
    assert parts.reconciler.report_providers == (
        parts.autoscaler.reports, parts.autoscaler.mode_reports, parts.watchdog.reports,
        parts.logwatch.reports, parts.stall_watch.reports, parts.reads.reports)
    assert parts.periodic.watchdog is parts.watchdog and parts.peering is None


def test_status_refreshes_reach_the_reconciler_made_last(parts, monkeypatch):
    refreshed = []
    monkeypatch.setattr(parts.reconciler, "refresh", lambda ns, name: refreshed.append(name))
    for i, refresh in enumerate((parts.autoscaler.reconcile, parts.logwatch.reconcile,
                                 parts.remediator.reconcile, parts.reads.refresh)):
        refresh("ns", f"m{i}")
    assert refreshed == ["m0", "m1", "m2", "m3"]


@pytest.mark.parametrize("parts", [["--peering", "vlm-operator-a"]], indirect=True)
def test_with_peering_only_the_active_replica_acts_and_marks(parts, monkeypatch):
    assert parts.peering.name == "vlm-operator-a"
    assert parts.logwatch.may_mark == parts.peering.may_act  # a cached read will do
    assert parts.periodic._may_act == parts.peering.may_act
    asked = []
    monkeypatch.setattr(parts.peering, "may_act",
                        lambda ns, fresh=False: asked.append((ns, fresh)) or False)
    assert not parts.remediator.may_act("ns")
    assert asked == [("ns", True)]  # a remediation reads the peering object afresh


@pytest.mark.parametrize("parts", [["--standalone", "--node-autoscaler-pending-gpus", "4",
                                    "--node-autoscaler-timeout-seconds", "300"]],
                         indirect=True)
def test_node_autoscaler_capacity_reaches_the_budget_and_the_surges(parts):
    from vlm_operator.k8s.gpu_plan import Growth

    assert parts.budget.growth == Growth(4, 4, 300.0)
    assert parts.remediator.unschedulable_limit_s == 300.0


def test_existing_nodes_only_by_default(parts):
    from vlm_operator.remediation.steps import UNSCHEDULABLE_S

    assert parts.budget.growth is None
    assert parts.remediator.unschedulable_limit_s == UNSCHEDULABLE_S
