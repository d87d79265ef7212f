"""What a PromQL query reads, as far as tenancy goes. Pure.

A KEDA ScaledObject's query runs with keda-operator's access to a Prometheus that usually holds
every namespace's series; a tenant's query that reads another namespace's series would let the
tenant read them back through its own replica count. So a user-supplied query is accepted only
when every vector selector in it carries the VLMDeployment's namespace as an equality matcher
(`namespace="<ns>"`): a bare metric name, a regex or negative namespace matcher, or a selector
without one is refused.

The check tokenizes the query (strings, numbers and durations, identifiers, punctuation) and
walks it: an identifier followed by `(` is a function or aggregation (so is an aggregation
followed by by/without), a label list after
by/without/on/ignoring/group_left/group_right is skipped, `{...}` is a selector's matchers, and
any other identifier that is not a keyword is a bare selector. It does not validate PromQL
(Prometheus does that when KEDA queries); it only finds every place series are selected.

The queries the operator writes itself (`keda_queries`: the default query on
spec.autoscaling.metric, the KV-cache query) are built here too, so validation puts each through
the same check before a ScaledObject carries it; the metric is a metric name (the CRD's
METRIC_NAME pattern), pasted into them as is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from vlm_operator.api import scaling_signals

# A Prometheus metric name (the data model's [a-zA-Z_:][a-zA-Z0-9_:]*): what spec.autoscaling.metric
# may hold, since it is pasted into queries and read from /metrics by name.
METRIC_NAME = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"
MAX_METRIC_NAME = 200
_METRIC_NAME = re.compile(METRIC_NAME.strip("^$"))
MAX_QUERY_LENGTH = 4096  # a tenant's query: tokenized in Python, at every reconcile
MAX_IMAGES_PER_REQUEST = 32  # caps KEDA's ratio while requests are in flight and none finished
_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>(?:0x[0-9a-fA-F]+|[0-9][0-9a-zA-Z.]*|\.[0-9]+[0-9a-zA-Z]*))
  | (?P<colon>:(?=[0-9]))
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],@])
""", re.VERBOSE)
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "start", "end",
                       "atan2"})
_LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                           "count_values", "bottomk", "topk", "quantile", "limitk",
                           "limit_ratio"})


class QueryError(ValueError):
    """The query cannot be read (an unknown character, an unclosed brace or string)."""


def _tokens(query: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(query):
        m = _TOKEN.match(query, pos)
        if m is None:
            raise QueryError(f"unexpected {query[pos]!r} at character {pos + 1}")
        pos = m.end()
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
    return out


def _skip_list(tokens: list[tuple[str, str]], i: int) -> int:
    """The index after the parenthesised label list that starts at tokens[i] (if one does)."""
    if i >= len(tokens) or tokens[i][1] != "(":
        return i
    while i < len(tokens) and tokens[i][1] != ")":
        i += 1
    return i + 1


def _matchers(tokens: list[tuple[str, str]], i: int) -> tuple[list[tuple[str, str, str]], int]:
    """(label, operator, value) of the selector whose `{` is tokens[i], and the index after its
    `}`."""
    found, i = [], i + 1
    while i < len(tokens) and tokens[i][1] != "}":
        if (tokens[i][0] == "ident" and i + 2 < len(tokens)
                and tokens[i + 1][1] in ("=", "!=", "=~", "!~") and tokens[i + 2][0] == "string"):
            found.append((tokens[i][1], tokens[i + 1][1], tokens[i + 2][1][1:-1]))
            i += 3
        else:
            i += 1
    if i >= len(tokens):
        raise QueryError("a selector's '{' is never closed")
    return found, i + 1


def selectors(query: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Every vector selector of the query: (metric name or "", its matchers)."""
    tokens = _tokens(query)
    out, i = [], 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text in _LABEL_LISTS:
            i = _skip_list(tokens, i + 1)
        elif kind == "ident" and (following == "(" or (
                text in _AGGREGATIONS and following in ("by", "without"))):
            i += 1  # a function or aggregation; its arguments are walked in turn
        elif kind == "ident" and following == "{":
            found, i = _matchers(tokens, i + 1)
            out.append((text, found))
        elif text == "{":
            found, i = _matchers(tokens, i)
            out.append(("", found))
        elif kind == "ident" and text.lower() not in _KEYWORDS:
            out.append((text, []))
            i += 1
        else:
            i += 1
    return out


def namespace_problems(query: str, namespace: str, where: str) -> list[str]:
    """Why `query` may read series of other namespaces than `namespace` ([] when it may not)."""
    try:
        found = selectors(query)
    except QueryError as exc:
        return [f"{where}: cannot read the query ({exc})"]
    if not found:
        return [f"{where}: selects no series"]
    wanted = ("namespace", "=", namespace)
    bad = [name or "{...}" for name, matchers in found if wanted not in matchers]
    if not bad:
        return []
    return [f"{where}: every selector must carry namespace=\"{namespace}\" (an equality "
            f"matcher) so the query reads only this namespace's series; "
            f"{', '.join(dict.fromkeys(bad))} do{'es' if len(set(bad)) == 1 else ''} not"]


def is_metric_name(text: str) -> bool:
    return len(text) <= MAX_METRIC_NAME and _METRIC_NAME.fullmatch(text) is not None


def pods_selector(namespace: str, name: str) -> str:
    """The matchers of a VLMDeployment's pods' series: its namespace, and pods named as its
    Deployment names them."""
    return f'{{namespace="{namespace}",pod=~"{name}-[a-z0-9]+-[a-z0-9]+"}}'


def default_query(scaling: Mapping[str, Any], namespace: str, name: str) -> str:
    """Total of the metric over this VLMDeployment's pods (KEDA divides by the replicas), each
    request weighed 1 + multimodalWeight x the images per request finished over 2 minutes."""
    sel = pods_selector(namespace, name)
    total = f"sum({scaling['metric']}{sel})"
    weight = scaling["multimodalWeight"]
    if not weight:
        return total
    images = f"(sum(rate(vllm:mm_cache_queries_total{sel}[2m])) or vector(0))"
    done = f"(sum(rate(vllm:request_success_total{sel}[2m])) or vector(0))"
    ratio = f"clamp_max({images} / clamp_min({done}, 0.001), {MAX_IMAGES_PER_REQUEST})"
    return f"{total} * (1 + {weight:g} * {ratio})"


def keda_queries(scaling: Mapping[str, Any], namespace: str,
                 name: str) -> list[tuple[str, str]]:
    """(the field it comes from, the query) of each trigger of a KEDA ScaledObject, in order:
    the tenant's query or the default one on the metric, then the sum of each capacity signal
    (api/scaling_signals.py)."""
    own = (scaling.get("prometheus") or {}).get("query")
    return [("spec.autoscaling.prometheus.query", own) if own else
            ("spec.autoscaling.metric", default_query(scaling, namespace, name)),
            *(("spec.autoscaling", f"sum({signal.metric}{pods_selector(namespace, name)})")
              for signal in scaling_signals.SIGNALS)]
