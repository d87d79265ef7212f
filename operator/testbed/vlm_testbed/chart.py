"""The Helm chart as `helm template` renders it (helm from hack/helm.sh, fetched once)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]  # the repository (operator/testbed/vlm_testbed/)
CHART = ROOT / "charts" / "vlm-operator"


@functools.cache
def helm() -> str:
    """The helm binary's path."""
    return subprocess.run([str(ROOT / "hack" / "helm.sh")], check=True, capture_output=True,
                          text=True).stdout.strip()


def template(*args: str, release: str = "rel", namespace: str = "vlm-system") -> list[dict]:
    """The chart's objects for these helm arguments (--set ...), empty documents dropped."""
    out = subprocess.run([helm(), "template", release, str(CHART), "--namespace", namespace,
                          *args], check=True, capture_output=True, text=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]
