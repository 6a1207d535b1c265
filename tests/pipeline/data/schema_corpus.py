"""The proof corpus of `format: {json_schema}`: JSON Schemas of the shapes people ask for (nested objects, arrays
with minItems/maxItems, enums, patterns, bounded numbers, anyOf, $ref, additionalProperties: false, formats,
const, tuples, nullable fields), each with the question asked and a token budget that a whole answer fits in.

`CORPUS`: (name, question, schema, max_new_tokens). Strings are bounded (maxLength) in most: a small model
left an unbounded string may write until its budget runs out, and the test counts how many stop by themselves.
"""

from __future__ import annotations

from typing import Any

Entry = tuple[str, str, dict[str, Any], int]


def _obj(properties: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required or list(properties)}
    if closed:
        schema["additionalProperties"] = False
    return schema


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}
AGE = {"type": "integer", "minimum": 0, "maximum": 130}
PRICE = {"type": "number", "minimum": 0, "maximum": 10000}
POINT = _obj({"x": {"type": "number"}, "y": {"type": "number"}})

CORPUS: list[Entry] = [
    ("person", "Describe a person.", _obj({"name": NAME, "age": AGE}), 32),
    ("city", "Name a city and its country.", _obj({"city": NAME, "country": NAME}), 32),
    ("book", "Describe a book.", _obj({"title": SHORT, "author": NAME, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}}), 48),
    ("yes_no", "Is the sky blue?", _obj({"answer": {"type": "boolean"}}), 16),
    ("color_enum", "Pick a color.", _obj({"color": {"enum": ["red", "green", "blue"]}}), 16),
    ("mood_enum", "How do you feel?", _obj({"mood": {"enum": ["happy", "sad", "neutral", "angry"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5}}), 24),
    ("rating", "Rate a film from 1 to 10.", _obj({"film": NAME, "rating": {"type": "integer", "minimum": 1, "maximum": 10}}), 32),
    ("temperature", "What is the temperature outside?", _obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60}}), 20),
    ("probability", "Give a probability.", _obj({"p": {"type": "number", "minimum": 0, "maximum": 1}}), 20),
    ("exclusive", "Give a positive number below 100.", _obj({"n": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}), 20),
    ("product", "Describe a product for sale.", _obj({"name": NAME, "price": PRICE, "in_stock": {"type": "boolean"}}), 40),
    ("tags", "Give three tags for a blog post about cats.", _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3}}), 40),
    ("numbers", "List two to four small numbers.", _obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4}}), 32),
    ("empty_ok", "List any allergies (there may be none).", _obj({"allergies": {"type": "array", "items": NAME, "maxItems": 3}}), 48),
    ("one_item", "Name exactly one fruit in a list.", _obj({"fruits": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 1}}), 24),
    ("zip_pattern", "Give a US zip code.", _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}), 20),
    ("code_pattern", "Give a product code like ABC-1234.", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}), 24),
    ("hex_color", "Give a color in hex.", _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}), 20),
    ("phone", "Give a phone number.", _obj({"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}}), 24),
    ("slug", "Give a URL slug for 'Hello World'.", _obj({"slug": {"type": "string", "pattern": "^[a-z0-9]+(-[a-z0-9]+){0,4}$", "maxLength": 30}}), 24),
    ("date", "When is the next holiday?", _obj({"date": {"type": "string", "format": "date"}}), 24),
    ("email", "Give an email address.", _obj({"email": {"type": "string", "format": "email", "maxLength": 40}}), 32),
    ("uuid", "Give a UUID.", _obj({"id": {"type": "string", "format": "uuid"}}), 48),
    ("const", "Report the status.", _obj({"version": {"const": 2}, "status": {"enum": ["ok", "fail"]}}), 20),
    ("nested", "Describe a user and their address.", _obj({"user": _obj({"name": NAME, "address": _obj({"street": SHORT, "city": NAME})})}), 64),
    ("deep", "Fill in the settings.", _obj({"a": _obj({"b": _obj({"c": _obj({"value": {"type": "integer", "minimum": 0, "maximum": 9}})})})}), 40),
    ("point", "Give a point on a plane.", _obj({"point": POINT}), 32),
    ("line", "Give a line segment.", _obj({"start": POINT, "end": POINT}), 48),
    ("people", "List two people with ages.", _obj({"people": {"type": "array", "items": _obj({"name": NAME, "age": AGE}), "minItems": 2, "maxItems": 2}}), 64),
    ("matrix", "Give a 2 by 2 matrix of digits.", _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}), 40),
    ("tuple", "Give a name and an age as a pair.", _obj({"pair": {"type": "array", "prefixItems": [NAME, AGE], "items": False, "minItems": 2}}), 32),
    ("optional", "Describe a pet; its age only if known.", _obj({"name": NAME, "species": {"enum": ["cat", "dog", "bird"]}, "age": AGE}, required=["name", "species"]), 40),
    ("nullable", "Give a middle name, or null if none.", _obj({"first": NAME, "middle": {"type": ["string", "null"], "maxLength": 20}}), 32),
    ("any_of_value", "Give a value: a number or a word.", _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "string", "maxLength": 12}]}}), 24),
    ("any_of_shape", "Give a circle or a square.", _obj({"shape": {"anyOf": [_obj({"kind": {"const": "circle"}, "radius": PRICE}), _obj({"kind": {"const": "square"}, "side": PRICE})]}}), 40),
    ("any_of_top", "Say ok, or give an error code.", {"anyOf": [_obj({"ok": {"const": True}}), _obj({"error": {"type": "integer", "minimum": 100, "maximum": 599}})]}, 24),
    ("ref_defs", "Give two points.", {"type": "object", "$defs": {"p": POINT}, "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}}, "required": ["a", "b"], "additionalProperties": False}, 64),
    ("ref_array", "List up to three items with a name and a price.", {"type": "object", "$defs": {"item": _obj({"name": NAME, "price": PRICE})}, "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}}, "required": ["items"], "additionalProperties": False}, 96),
    ("ref_nested", "Give a team with a leader.", {"type": "object", "$defs": {"person": _obj({"name": NAME})}, "properties": {"team": _obj({"name": NAME, "leader": {"$ref": "#/$defs/person"}})}, "required": ["team"], "additionalProperties": False}, 48),
    ("all_of", "Give an id and a name.", {"allOf": [_obj({"id": AGE, "name": NAME}, closed=False), {"required": ["id"]}]}, 40),
    ("open_object", "Describe the weather.", {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy", "rain"]}}, "required": ["sky"]}, 48),
    ("integer_range", "Pick a number from 1 to 6.", _obj({"die": {"type": "integer", "minimum": 1, "maximum": 6}}), 16),
    ("negative", "Give a temperature below zero.", _obj({"t": {"type": "integer", "minimum": -50, "maximum": -1}}), 16),
    ("string_len", "Give a word of 3 to 5 letters.", _obj({"word": {"type": "string", "minLength": 3, "maxLength": 5}}), 20),
    ("array_top", "List three colors.", {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "minItems": 3, "maxItems": 3}, 24),
    ("enum_array", "Pick one or two weekdays.", _obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}, "minItems": 1, "maxItems": 2}}), 24),
    ("mixed_enum", "Give an answer.", _obj({"answer": {"enum": ["yes", "no", 1, 0, True, None]}}), 16),
    ("order", "Describe an order.", _obj({"order_id": {"type": "string", "pattern": "^ORD[0-9]{4}$"}, "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}, "paid": {"type": "boolean"}}), 96),
    ("event", "Describe a meeting.", _obj({"title": SHORT, "day": {"type": "string", "format": "date"}, "attendees": {"type": "integer", "minimum": 1, "maximum": 50}}), 56),
    ("review", "Review a restaurant.", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": {"type": "string", "maxLength": 60}, "recommend": {"type": "boolean"}}), 64),
    ("version", "Give a version number.", _obj({"version": {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"}}), 24),
    ("coords", "Give the coordinates of a city.", _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}}), 40),
    ("null_only", "Give nothing.", _obj({"nothing": {"type": "null"}}), 12),
    ("bool_list", "Give two booleans.", _obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}), 20),
    ("recipe", "Give a recipe.", _obj({"dish": NAME, "minutes": {"type": "integer", "minimum": 1, "maximum": 300}, "steps": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3}}), 96),
]
