"""vLLM versions: reading them from image references, and which flags each one has.

Passing a flag a vLLM version lacks makes `vllm serve` exit at start-up, so every version-dependent
flag is listed here with the first release that accepts it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# The one place a new vLLM release is written on the operator's side (docs/contributing.md):
# the plugin's SUPPORTED, README's range and the default image follow it, tied by tests.
SUPPORTED_MIN = (0, 11, 0)
KNOWN_LATEST = (0, 33)
DEFAULT_RELEASE = (0, 33, 0)  # the vLLM of the default image (crd_spec.DEFAULT_IMAGE)

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-.+]?[A-Za-z0-9.+-]*)?$")

# flag -> first vLLM release that has it
FLAG_SINCE: dict[str, tuple[int, int, int]] = {
    "--renderer-num-workers": (0, 19, 0),
}


class Version(NamedTuple):
    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def parse_version(text: str) -> Version | None:
    """`0.20.2`, `v0.20.2`, `v0.20.2-pool1`, `0.11` -> Version; anything else -> None."""
    match = _VERSION.match(text.strip())
    if not match:
        return None
    major, minor, patch = match.groups()
    return Version(int(major), int(minor), int(patch or 0))


def image_tag(image: str) -> str | None:
    """The tag of an image reference (`registry:5000/a/b:tag@sha256:...` -> `tag`)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    return last.rsplit(":", 1)[1] or None


def version_from_image(image: str) -> Version | None:
    tag = image_tag(image)
    return parse_version(tag) if tag else None


def has_flag(version: Version, flag: str) -> bool:
    since = FLAG_SINCE.get(flag)
    return since is None or tuple(version) >= since


def support_problem(version: Version) -> str | None:
    """Why a version cannot be served, or None. Newer-than-known versions are allowed."""
    if tuple(version) < SUPPORTED_MIN:
        low = ".".join(map(str, SUPPORTED_MIN))
        return f"vLLM {version} is older than the oldest supported version {low}"
    return None


def is_newer_than_known(version: Version) -> bool:
    return (version.major, version.minor) > KNOWN_LATEST
