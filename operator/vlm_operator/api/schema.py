"""Small constructors for OpenAPI v3 schema nodes.

The CRD schema is written in Python so that one definition feeds the CRD that `vlm-operator crd`
prints, the manifests, the chart and the offline validation in `render`. Every node carries a
description because `kubectl explain` shows it.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _node(kind: str, description: str, **extra: Any) -> Schema:
    node: Schema = {"type": kind, "description": description}
    node.update({k: v for k, v in extra.items() if v is not None})
    return node


def string(description: str, *, default: str | None = None, enum: list[str] | None = None,
           pattern: str | None = None, min_length: int | None = None,
           max_length: int | None = None) -> Schema:
    return _node("string", description, default=default, enum=enum, pattern=pattern,
                 minLength=min_length, maxLength=max_length)


def integer(description: str, *, default: int | None = None, minimum: int | None = None,
            maximum: int | None = None) -> Schema:
    return _node("integer", description, default=default, minimum=minimum, maximum=maximum)


def number(description: str, *, default: float | None = None, minimum: float | None = None,
           maximum: float | None = None) -> Schema:
    return _node("number", description, default=default, minimum=minimum, maximum=maximum)


def boolean(description: str, *, default: bool | None = None) -> Schema:
    return _node("boolean", description, default=default)


def obj(description: str, properties: dict[str, Schema] | None = None, *,
        required: list[str] | None = None, default: dict | None = None,
        additional: Schema | None = None, preserve_unknown: bool = False) -> Schema:
    node = _node("object", description, default=default, required=required,
                 properties=properties, additionalProperties=additional)
    if preserve_unknown:
        node["x-kubernetes-preserve-unknown-fields"] = True
    return node


def array(description: str, items: Schema, *, max_items: int | None = None,
          list_type: str | None = None, list_map_keys: list[str] | None = None) -> Schema:
    node = _node("array", description, items=items, maxItems=max_items)
    if list_type:
        node["x-kubernetes-list-type"] = list_type
    if list_map_keys:
        node["x-kubernetes-list-map-keys"] = list_map_keys
    return node


def quantity(description: str) -> Schema:
    """A Kubernetes resource quantity: `4`, `500m`, `16Gi`."""
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                   r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
    }


def string_map(description: str) -> Schema:
    return obj(description, additional={"type": "string"})


def apply_defaults(value: Any, node: Schema) -> Any:
    """Fill in schema defaults the way the apiserver does (top-down, defaults of defaults too).

    `render` runs without a cluster, so it must see the same defaulted object the apiserver
    would store.
    """
    if isinstance(value, dict) and node.get("type") == "object":
        out = dict(value)
        for key, child in (node.get("properties") or {}).items():
            if key not in out and "default" in child:
                out[key] = _copy(child["default"])
            if key in out:
                out[key] = apply_defaults(out[key], child)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(out) - set(node.get("properties") or {}):
                out[key] = apply_defaults(out[key], extra)
        return out
    if isinstance(value, list) and node.get("type") == "array":
        return [apply_defaults(item, node["items"]) for item in value]
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def section(obj: dict, key: str) -> dict:
    """obj[key] when it is a mapping, else {}: spec checks run even on schema-invalid input."""
    value = obj.get(key)
    return value if isinstance(value, dict) else {}
