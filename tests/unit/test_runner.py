"""runner.configure: kopf's own requests have deadlines, and its retries never run out (its
default list ends the watch streams, and with them the operator, after a minute of outage)."""

import argparse
import itertools
import logging

import kopf

from vlm_operator import runner


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
