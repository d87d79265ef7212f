"""Images on a simulated node: a configurable pull time per image, paid once per node (the node
remembers what it pulled), pulls one at a time per node (the kubelet's default
serializeImagePulls), and the kubelet's Pulling / Pulled Events."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import events

if TYPE_CHECKING:
    from .processes import Container

# A vLLM image's pull on a node that lacks it, for benches that model real nodes (the
# simulator's default is 0 so tests stay fast). An assumption, not a measurement: the
# vllm/vllm-openai images are over 10 GB compressed; at about 100 MB/s from the registry plus
# unpacking that is about 3 minutes.
VLLM_IMAGE_PULL_S = 180.0

PullSeconds = Callable[[str], float]


def pull_seconds(spec: float | dict[str, float] | PullSeconds) -> PullSeconds:
    """image -> seconds its pull takes, from a number (every image), a dict (missing: 0) or a
    function."""
    if callable(spec):
        return spec
    if isinstance(spec, dict):
        return lambda image: float(spec.get(image, 0.0))
    return lambda image: float(spec)


def pull_policy(container: dict) -> str:
    """The pod's imagePullPolicy, defaulted as the apiserver does: Always for :latest or no
    tag, else IfNotPresent."""
    if container.get("imagePullPolicy"):
        return container["imagePullPolicy"]
    image = container.get("image", "")
    tagged = ":" in image.rsplit("/", 1)[-1] or "@" in image
    return "IfNotPresent" if tagged and not image.endswith(":latest") else "Always"


class NodeImages:
    """The images each simulated node holds."""

    def __init__(self, seconds: PullSeconds) -> None:
        self.seconds = seconds
        self.present: dict[str, set[str]] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.lock = threading.Lock()

    def has(self, node: str, image: str) -> bool:
        with self.lock:
            return image in self.present.get(node, set())

    def ensure(self, container: Container) -> bool:
        """Make the container's image present on its node as the kubelet does before creating
        the container (its state stays waiting ContainerCreating meanwhile); False when it
        cannot be (pull policy Never and no image: ErrImageNeverPull) or the pod stopped."""
        pod, spec = container.pod, container.spec
        node, image = pod.spec.get("nodeName", ""), spec.get("image", "")
        policy = pull_policy(spec)

        def event(reason: str, message: str, warning: bool = False) -> None:
            events.record(pod.sim.core, pod.pod, reason, message, warning=warning, host=node,
                          container=container.name)

        if policy != "Always" and self.has(node, image):
            event("Pulled", f'Container image "{image}" already present on machine')
            return True
        if policy == "Never":
            message = f'Container image "{image}" is not present with pull policy of Never'
            container.waiting = ("ErrImageNeverPull", message)
            pod.changed()
            event("ErrImageNeverPull", message, warning=True)
            return False
        with self.lock:
            node_lock = self.locks.setdefault(node, threading.Lock())
        with node_lock:
            if container.stop.is_set():
                return False
            present = self.has(node, image)
            if policy != "Always" and present:
                event("Pulled", f'Container image "{image}" already present on machine')
                return True
            event("Pulling", f'Pulling image "{image}"')
            started = time.monotonic()
            if not present and container.stop.wait(self.seconds(image)):
                return False
            with self.lock:
                self.present.setdefault(node, set()).add(image)
            took = events.go_duration(time.monotonic() - started)
            event("Pulled", f'Successfully pulled image "{image}" in {took}')
        return True
