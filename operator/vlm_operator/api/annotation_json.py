"""JSON read back from annotation text. Whoever may edit an object can write its annotations
(a tenant its VLMDeployment and its pods), so the text is hostile: its length is checked
before anything else; the C parser (linear in the text) recurses once per level and stops
with RecursionError at the interpreter's limit (200 KB of `[` raise it at once), which stays
here with every other exception it can raise; and a value nesting deeper than MAX_DEPTH is
refused, checked without recursion, so no caller recurses over what a tenant chose. A bad
value is UNREADABLE, never an exception and never mistaken for an absent annotation: the
caller decides what unknown means for it. Pure."""

from __future__ import annotations

import json

# the apiserver's limit on all of an object's annotations together: no one value is longer
MAX_CHARS = 262_144
MAX_DEPTH = 8  # the operator's own values nest 3 deep at most (in-flight: {uid: {before: []}})


_CONTAINERS = frozenset((dict, list))  # what json.loads makes that nests


class _Unreadable:
    """The value of annotation text that is too long, too deep or not JSON."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNREADABLE"


UNREADABLE = _Unreadable()


def too_deep(value: object, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep in a parsed value: level by
    level, without recursion on what a tenant chose, empty ones not looked into."""
    if value.__class__ not in _CONTAINERS:
        return False
    level, depth = [value], 1
    while level:
        deeper: list = []
        for node in level:
            found = [c for c in (node.values() if node.__class__ is dict else node)
                     if c.__class__ in _CONTAINERS]
            if found and depth >= limit:
                return True
            deeper += filter(None, found)
        level, depth = deeper, depth + 1
    return False


def read(raw: object, *, max_chars: int = MAX_CHARS, max_depth: int = MAX_DEPTH) -> object:
    """The JSON value of annotation text `raw`: None when there is none (absent or empty),
    UNREADABLE when it is not a string, longer than `max_chars`, nested deeper than
    `max_depth` or not JSON. Never raises."""
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str) or len(raw) > max_chars:
        return UNREADABLE
    try:  # the C parser: linear, and its recursion ends at the interpreter's limit
        value = json.loads(raw)
    except Exception:  # ValueError, RecursionError, MemoryError: all the same to a caller
        return UNREADABLE
    if raw.count("[") + raw.count("{") > max_depth and too_deep(value, max_depth):
        return UNREADABLE
    return value
