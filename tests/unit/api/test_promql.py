"""A tenant's KEDA query may read only its own namespace's series: every vector selector must
carry namespace="<ns>" as an equality matcher."""

import pytest

from vlm_operator.api import promql

NS = "team-a"


@pytest.mark.parametrize("query", [
    'sum(vllm:num_requests_waiting{namespace="team-a"})',
    'sum by (pod) (rate(vllm:request_success_total{namespace="team-a",pod=~"m-.*"}[5m]))',
    'max(vllm:kv_cache_usage_perc{namespace="team-a"}) without (engine)',
    'sum(x{namespace="team-a"}) / on(pod) group_left(model) y{namespace="team-a"}',
    '{__name__="x",namespace="team-a"} offset 5m',
    'max_over_time(x{namespace="team-a"}[10m:1m]) # the peak',
    'sum(x{namespace=`team-a`}) or vector(0)',
    'histogram_quantile(0.9, sum by (le) (rate(x_bucket{namespace="team-a"}[1m])))',
    'sum(x{namespace="team-a", namespace=~".*"})',  # still only team-a: matchers intersect
    'count(x{namespace="team-a"} > bool 3)',
])
def test_queries_confined_to_the_namespace_pass(query):
    assert promql.namespace_problems(query, NS, "q") == []


@pytest.mark.parametrize("query,bad", [
    ("sum(vllm:num_requests_waiting)", "vllm:num_requests_waiting"),
    ('sum(x{pod="p"})', "x"),
    ('sum(x{namespace="team-b"})', "x"),
    ('sum(x{namespace=~"team-a"})', "x"),  # a regex may match more: only equality counts
    ('sum(x{namespace!="team-a"})', "x"),
    ('sum(x{namespace="team-a"}) + sum(y)', "y"),
    ('x{namespace="team-a"} and on(pod) y', "y"),
    ('{__name__=~"vllm:.+"}', "{...}"),
    ('sum by (namespace) (rate(x[5m]))', "x"),
])
def test_a_selector_without_the_namespace_is_named(query, bad):
    (problem,) = promql.namespace_problems(query, NS, "spec.autoscaling.prometheus.query")
    assert problem.startswith('spec.autoscaling.prometheus.query: every selector must carry '
                              'namespace="team-a"')
    assert problem.endswith(f"; {bad} does not")


@pytest.mark.parametrize("query,why", [
    ('sum(x{namespace="team-a"', "a selector's '{' is never closed"),
    ('sum(x{namespace="team-a"}) $ 3', "unexpected '$' at character 28"),
    ("vector(1)", "selects no series"),
])
def test_unreadable_queries_are_refused(query, why):
    (problem,) = promql.namespace_problems(query, NS, "q")
    assert why in problem


INJECTION = ('vllm:num_requests_running{namespace="team-b"}) + 0 * '
             'sum(vllm:num_requests_running')


def keda(**scaling):
    from vlm_operator.api import crd
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": "demo", "namespace": NS},
            "spec": {"model": "m", "autoscaling": {"enabled": True, "mode": "KEDA", **scaling}}}


@pytest.mark.parametrize("mode", ["Builtin", "HPA", "KEDA"])
@pytest.mark.parametrize("metric", [
    INJECTION, 'vllm:x{namespace="team-b"}', "vllm:x or vector(1)", "vllm:x\n", "", "1x",
    "x" * 201])
def test_the_metric_must_be_a_metric_name(metric, mode):
    """spec.autoscaling.metric is pasted into KEDA's query (and named in HPA's and Builtin's
    reads): anything but a metric name is refused, naming the field."""
    from vlm_operator.api.validation import validate
    problems, _ = validate(keda(mode=mode, metric=metric))
    assert problems and all(p.startswith("spec.autoscaling.metric: ") for p in problems), problems


def test_the_injection_is_refused_for_reading_another_namespace():
    """The default query on the metric goes through the same check as a tenant's own query."""
    from vlm_operator.api.validation import validate
    problems, _ = validate(keda(metric=INJECTION))
    assert any(p.startswith('spec.autoscaling.metric: every selector must carry '
                            'namespace="team-a"') for p in problems), problems


@pytest.mark.parametrize("scaling", [
    {}, {"metric": "vllm:num_requests_running", "multimodalWeight": 0},
    {"metric": "vllm:gpu_cache_usage_perc", "multimodalWeight": 2.5},
    {"prometheus": {"query": 'sum(x{namespace="team-a"})'}}])
def test_every_query_of_the_scaled_object_reads_only_the_namespace(scaling):
    from vlm_operator.api.validation import parse
    from vlm_operator.desired.autoscaler_objects import get_scaled_object
    vlmd = parse(keda(**scaling))
    triggers = get_scaled_object(vlmd, {"name": "demo"}, "http://p")["spec"]["triggers"]
    queries = [t["metadata"]["query"] for t in triggers]
    assert queries == [q for _, q in promql.keda_queries(vlmd.spec["autoscaling"], NS, "demo")]
    for query in queries:
        assert promql.namespace_problems(query, NS, "q") == []


def test_a_query_over_the_length_is_refused_without_reading_it():
    from vlm_operator.api.validation import validate
    query = 'sum(x{namespace="team-a"})' + " " * promql.MAX_QUERY_LENGTH
    problems, _ = validate(keda(prometheus={"query": query}))
    assert problems == [f"spec.autoscaling.prometheus.query: {query!r} is too long"]
