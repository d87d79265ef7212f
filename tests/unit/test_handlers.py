"""handlers._news: kopf re-lists on every reconnect and hands each object over again; only an
object at a resourceVersion not seen yet (or gone) is news worth a reconcile."""

from vlm_operator.handlers import _news


def event(kind, uid="u1", rv="5"):
    return {"type": kind, "object": {"metadata": {"uid": uid, "resourceVersion": rv}}}


def test_a_relisted_object_at_the_same_version_is_no_news():
    seen = {}
    assert _news(seen, event(None))  # first sight (kopf's listing at start)
    assert not _news(seen, event(None))  # re-listed after a reconnect: nothing changed
    assert not _news(seen, event("MODIFIED"))  # the watch's copy of the same version
    assert _news(seen, event("MODIFIED", rv="6"))
    assert _news(seen, event(None, rv="9"))  # changed while the watch was down
    assert _news(seen, event("DELETED", rv="9")) and seen == {}
    assert _news(seen, {"type": None, "object": {}})  # unreadable: reconcile to be safe


def test_a_new_version_that_only_moved_the_log_mark_is_no_news():
    """The operator writes a resume mark on each followed pod every few minutes: that pod
    event must not cost a reconcile of the VLMDeployment (about 10 requests)."""
    from vlm_operator.api.names import LOG_MARK

    def pod(rv, mark, ready="True"):
        return {"type": "MODIFIED", "object": {
            "metadata": {"uid": "p", "resourceVersion": rv, "managedFields": [{"m": rv}],
                         "annotations": {"a": "1", LOG_MARK: mark}},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}}}

    seen = {}
    assert _news(seen, pod("1", "m1"))
    assert not _news(seen, pod("2", "m2"))  # only the mark moved
    assert _news(seen, pod("3", "m2", ready="False"))  # a real change
    assert not _news(seen, pod("3", "m2", ready="False"))


def test_a_reconcile_that_raises_is_logged_and_counted_never_escaping(caplog):
    """Whatever a reconcile raises besides an API error (a tenant's resource it cannot read)
    stays in handlers.reconcile: the periodic resync's loop over VLMDeployments calls it."""
    from types import SimpleNamespace

    import kopf
    import pytest

    from vlm_operator.handlers import reconcile
    from vlm_operator.metrics import RECONCILES

    class Raising:
        def reconcile(self, namespace, name):
            raise RecursionError("maximum recursion depth exceeded")

    memo = SimpleNamespace(reconciler=Raising())
    errors = RECONCILES.labels(result="error")._value.get()
    reconcile(memo, "ns", "attacker", retry=False)  # the resync's call: no exception out
    assert RECONCILES.labels(result="error")._value.get() == errors + 1
    assert "reconcile of ns/attacker failed" in caplog.text
    with pytest.raises(kopf.PermanentError):  # kopf's call: no retry of the same failure
        reconcile(memo, "ns", "attacker", retry=True)
