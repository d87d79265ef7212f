"""JSON read back from annotation text. Whoever may edit an object can write its annotations
(a tenant its VLMDeployment and its pods), so the text is hostile: its length is checked
first, its nesting counted by one linear scan before the parser sees it (Python's parser
recurses once per level: 200 KB of `[` raise RecursionError), and every exception the parser
can raise stays here. A bad value is UNREADABLE, never an exception and never mistaken for an
absent annotation: the caller decides what unknown means for it. Pure."""

from __future__ import annotations

import json
import re

# the apiserver's limit on all of an object's annotations together: no one value is longer
MAX_CHARS = 262_144
MAX_DEPTH = 8  # the operator's own values nest 3 deep at most (in-flight: {uid: {before: []}})

_SPECIAL = re.compile(r'[\\"\[\]{}]')


class _Unreadable:
    """The value of annotation text that is too long, too deep or not JSON."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNREADABLE"


UNREADABLE = _Unreadable()


def nesting(text: str, limit: int) -> int:
    """How deep arrays and objects nest in `text` outside strings; the scan stops as soon as
    it passes `limit` (so the answer is then limit + 1). Linear in len(text)."""
    depth = deepest = 0
    in_string, skip = False, -1
    for match in _SPECIAL.finditer(text):
        at, char = match.start(), match.group()
        if at == skip:  # the character after a backslash in a string
            continue
        if in_string:
            if char == "\\":
                skip = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif char in "]}":
            depth -= 1
    return deepest


def read(raw: object, *, max_chars: int = MAX_CHARS, max_depth: int = MAX_DEPTH) -> object:
    """The JSON value of annotation text `raw`: None when there is none (absent or empty),
    UNREADABLE when it is not a string, longer than `max_chars`, nested deeper than
    `max_depth` or not JSON. Never raises."""
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str) or len(raw) > max_chars:
        return UNREADABLE
    try:
        if (raw.count("[") + raw.count("{") > max_depth
                and nesting(raw, max_depth) > max_depth):
            return UNREADABLE
        return json.loads(raw)
    except Exception:  # ValueError, RecursionError, MemoryError: all the same to a caller
        return UNREADABLE
