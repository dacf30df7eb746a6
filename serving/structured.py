"""A request's output constraint from its OpenAI `response_format` or vLLM `structured_outputs` field.

    response_format: {"type": "text"} | {"type": "json_object"} |
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    structured_outputs: {"json": schema | "regex": str | "choice": [str] | "grammar": lark | "json_object": true}

Bad or unsupported values raise ValueError naming the field (the app answers 400); the grammar itself is
compiled (and its errors named) when the engine admits the request.
"""

from __future__ import annotations

from typing import Any

from flashnext_jax.structured_output import StructuredOutputsParams, structured_from_request


def from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError("response_format: must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"response_format.type: {kind!r} is not supported (text, json_object, json_schema)")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema: must be an object with a 'schema'")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
    # strict or not, the output follows the schema: the grammar enforces it either way
    return StructuredOutputsParams(json=schema)


def constraint_of(response_format: dict | None, structured_outputs: dict | None) -> StructuredOutputsParams | None:
    """The request's constraint; giving both fields is ambiguous and refused."""
    if response_format is not None and structured_outputs is not None:
        raise ValueError("give response_format or structured_outputs, not both")
    if structured_outputs is not None:
        return structured_from_request(structured_outputs)
    if response_format is not None:
        return from_response_format(response_format)
    return None
