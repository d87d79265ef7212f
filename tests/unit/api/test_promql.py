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
