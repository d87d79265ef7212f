"""The Helm chart as `helm template` renders it, and installed by `helm install` (helm from
hack/helm.sh, fetched once)."""

from __future__ import annotations

import functools
import json
import subprocess
import time
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


def install(kubeconfig: str | Path, release: str, namespace: str, values: dict,
            timeout_s: float = 240) -> float:
    """`helm install --wait` of the chart with these values (written to a file beside the
    kubeconfig); the seconds it took. Raises with helm's output when it fails."""
    values_file = Path(kubeconfig).parent / f"values-{namespace}-{release}.json"
    values_file.write_text(json.dumps(values))
    t0 = time.monotonic()
    r = subprocess.run([helm(), "--kubeconfig", str(kubeconfig), "install", release, str(CHART),
                        "-n", namespace, "-f", str(values_file), "--wait", "--timeout",
                        f"{timeout_s:.0f}s"], capture_output=True, text=True,
                       timeout=timeout_s + 60)
    if r.returncode != 0:
        raise RuntimeError(f"helm install {release} -n {namespace} failed ({r.returncode}):\n"
                           f"{r.stdout}\n{r.stderr}")
    return time.monotonic() - t0


def uninstall(kubeconfig: str | Path, release: str, namespace: str) -> None:
    """`helm uninstall --wait`, best effort (teardown)."""
    subprocess.run([helm(), "--kubeconfig", str(kubeconfig), "uninstall", release, "-n",
                    namespace, "--wait"], capture_output=True, timeout=180)
