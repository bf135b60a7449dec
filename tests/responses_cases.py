"""`/v1/responses` input items generated from the installed vLLM's own request model (its JSON schema): one request
per branch of the `input` item union, and for every item field that holds content parts (a message's `content`, a
tool output's `output`), one per part branch, plus `null` and `[]` in that field. Not a hand list: a vLLM that adds
an item or a part type adds cases."""

from __future__ import annotations

from typing import Any


def _resolve(schema: dict, defs: dict) -> dict:
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _branches(schema: dict, defs: dict) -> list[dict]:
    schema = _resolve(schema, defs)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return [b for branch in schema[key] for b in _branches(branch, defs)]
    return [schema]


def example(schema: dict, defs: dict, depth: int = 0) -> Any:
    """The smallest instance of `schema`: its required fields, the first non-null branch of a union."""
    schema = _resolve(schema, defs)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    branches = [b for b in _branches(schema, defs) if b.get("type") != "null"]
    if len(branches) > 1 or (branches and branches[0] is not schema):
        return example(branches[0], defs, depth + 1) if branches else None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {k: example(props[k], defs, depth + 1) for k in schema.get("required", []) if k in props}
    if kind == "array":
        return [example(schema.get("items", {}), defs, depth + 1)] if depth < 6 else []
    return {"string": "x", "integer": 1, "number": 1.0, "boolean": False, "null": None}.get(kind, "x")


def _part_fields(item: dict, defs: dict) -> dict[str, list[dict]]:
    """The item's fields that take a list of typed parts: field -> the part branches."""
    found = {}
    for name, prop in item.get("properties", {}).items():
        for branch in _branches(prop, defs):
            if branch.get("type") == "array":
                parts = [p for p in _branches(branch.get("items", {}), defs) if "type" in p.get("properties", {})]
                if parts:
                    found[name] = parts
    return found


def _type_of(schema: dict, defs: dict) -> str:
    prop = schema.get("properties", {}).get("type")
    value = example(prop, defs) if prop else None
    return value if isinstance(value, str) else schema.get("title", "?")


def input_item_cases(schema: dict) -> list[tuple[str, list[dict]]]:
    """(what the case is, the request's `input`) for every item branch and, in each, every part branch, null, []."""
    defs = schema.get("$defs", {})
    array = next(b for b in _branches(schema["properties"]["input"], defs) if b.get("type") == "array")
    cases = []
    for branch in _branches(array["items"], defs):
        item = example(branch, defs)
        kind = _type_of(branch, defs)
        cases.append((f"{kind}", [item]))
        for field, parts in _part_fields(branch, defs).items():
            for part in parts:
                cases.append((f"{kind}.{field}[{_type_of(part, defs)}]", [{**item, field: [example(part, defs)]}]))
            cases.append((f"{kind}.{field}=null", [{**item, field: None}]))
            cases.append((f"{kind}.{field}=[]", [{**item, field: []}]))
    return cases
