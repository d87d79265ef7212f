"""Helpers every benchmark shares: the machine description, percentiles and process stats.
Standard library only, so benchmarks running in the tokenizer or vLLM venvs can import it too."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine(**extra) -> dict:
    """What a result was measured on: CPU, cores, load, Python, key package versions, commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "load_avg": os.getloadavg(),
            "platform": platform.platform(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit}
    info.update({dist: v for dist in ("kopf", "kubernetes") if (v := _version(dist))})
    return {**info, **extra}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
