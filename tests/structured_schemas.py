"""JSON schemas of the shapes real APIs use, each with a request for it, for the structured-output
tests (tests/test_structured_outputs.py) and the benchmark (benchmarks/structured.py): nested
objects, arrays with minItems/maxItems, enum, anyOf, $ref/$defs, additionalProperties: false,
required fields, numbers with bounds, string formats and patterns llguidance supports."""

from __future__ import annotations

from typing import Any

_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["street", "city", "zip"],
    "additionalProperties": False,
}

SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe a person as JSON with a name and an age.", {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }),
    ("weather", "Report today's weather in Paris as JSON.", {
        "type": "object",
        "properties": {
            "city": {"type": "string"}, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
        },
        "required": ["city", "temperature_c", "conditions"], "additionalProperties": False,
    }),
    ("tags", "List three tags for a blog post about cooking, as JSON.", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False,
    }),
    ("sentiment", "Classify the sentiment of 'I love this phone' as JSON.", {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"], "additionalProperties": False,
    }),
    ("address", "Give a US mailing address as JSON.", _ADDRESS),
    ("order", "Create an order for two books as JSON.", {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1},
            "items": {
                "type": "array", "minItems": 1, "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"title": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
                    "required": ["title", "quantity"], "additionalProperties": False,
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["order_id", "items", "paid"], "additionalProperties": False,
    }),
    ("refs", "Describe a company and its headquarters as JSON.", {
        "type": "object",
        "$defs": {"address": _ADDRESS},
        "properties": {"company": {"type": "string"}, "headquarters": {"$ref": "#/$defs/address"}},
        "required": ["company", "headquarters"], "additionalProperties": False,
    }),
    ("any_of", "Give a contact, by email or by phone, as JSON.", {
        "type": "object",
        "properties": {
            "contact": {
                "anyOf": [
                    {"type": "object", "properties": {"email": {"type": "string", "format": "email"}}, "required": ["email"], "additionalProperties": False},
                    {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}, "required": ["phone"], "additionalProperties": False},
                ]
            }
        },
        "required": ["contact"], "additionalProperties": False,
    }),
    ("date", "When was the first moon landing? Answer as JSON.", {
        "type": "object",
        "properties": {"event": {"type": "string"}, "date": {"type": "string", "format": "date"}},
        "required": ["event", "date"], "additionalProperties": False,
    }),
    ("nullable", "Describe a movie as JSON; its sequel may be null.", {
        "type": "object",
        "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "sequel": {"type": ["string", "null"]}},
        "required": ["title", "year", "sequel"], "additionalProperties": False,
    }),
    ("matrix", "Give a 2 by 2 matrix of small integers as JSON.", {
        "type": "object",
        "properties": {
            "rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}
        },
        "required": ["rows"], "additionalProperties": False,
    }),
    ("recipe", "Write a short recipe for toast as JSON.", {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "steps": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
            "minutes": {"type": "integer", "minimum": 1, "maximum": 60},
        },
        "required": ["name", "steps", "minutes"], "additionalProperties": False,
    }),
    ("boolean_flags", "Describe the features of a hotel room as JSON.", {
        "type": "object",
        "properties": {"wifi": {"type": "boolean"}, "breakfast": {"type": "boolean"}, "floor": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["wifi", "breakfast", "floor"], "additionalProperties": False,
    }),
    ("tool_args", "Call a function that books a flight from Paris to Rome; give its arguments as JSON.", {
        "type": "object",
        "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"}, "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}, "class": {"enum": ["economy", "business"]},
        },
        "required": ["origin", "destination", "passengers", "class"], "additionalProperties": False,
    }),
    ("optional_fields", "Describe a book as JSON.", {
        "type": "object",
        "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "pages": {"type": "integer", "minimum": 1, "maximum": 5000}},
        "required": ["title"], "additionalProperties": False,
    }),
    ("top_level_array", "List two colors as a JSON array of objects.", {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "object", "properties": {"color": {"type": "string"}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["color", "hex"], "additionalProperties": False},
    }),
    ("const_version", "Write a config file for an app as JSON.", {
        "type": "object",
        "properties": {"version": {"const": 2}, "debug": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
        "required": ["version", "debug", "level"], "additionalProperties": False,
    }),
    ("nested_defs", "Describe a family tree of a parent and one child as JSON.", {
        "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}},
        "type": "object",
        "properties": {"parent": {"$ref": "#/$defs/person"}, "children": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1, "maxItems": 2}},
        "required": ["parent", "children"], "additionalProperties": False,
    }),
    ("uuid_and_time", "Log an event with an id and a timestamp as JSON.", {
        "type": "object",
        "properties": {"id": {"type": "string", "format": "uuid"}, "at": {"type": "string", "format": "date-time"}, "level": {"enum": ["info", "error"]}},
        "required": ["id", "at", "level"], "additionalProperties": False,
    }),
    ("scores", "Give the scores of three players as JSON.", {
        "type": "object",
        "properties": {
            "scores": {"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "object", "properties": {"player": {"type": "string"}, "points": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["player", "points"], "additionalProperties": False}}
        },
        "required": ["scores"], "additionalProperties": False,
    }),
]  # fmt: skip


def bounded(schema: Any, max_length: int = 64) -> Any:
    """``schema`` with every string that has no ``maxLength``, ``enum`` or ``const`` given one of
    ``max_length`` characters: each answer then ends within a known number of tokens whatever
    path sampling takes (a free string is where a small model loops until ``max_tokens``)."""
    if isinstance(schema, list):
        return [bounded(s, max_length) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v, max_length) for k, v in schema.items()}
    types = schema.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if is_string and not {"maxLength", "enum", "const"} & set(schema):
        out["maxLength"] = max_length
    return out
