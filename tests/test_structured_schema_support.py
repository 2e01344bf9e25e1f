"""JSON-schema forms the xgrammar backend does not enforce are refused up front (kvshard/structured/json_schema.py).

For each refused form: `check_json_schema` raises a ValueError naming it and where it is ("(at PATH)"), and
xgrammar (compiled as the backend compiles a schema) really lets through an output that breaks the schema, so
the refusal is needed. For each supported form: the check passes, and xgrammar takes a valid output and masks an
invalid one. The repository's own schemas (the structured-output and agentic tests', pydantic's, the tool-call
constraint's) pass. Then the backend's compile path on the demo model's tokenizer: a refused schema (a dict or
its text) is a ValueError "structured_outputs.json could not be compiled: ...", which the OpenAI layer answers
as a 400 naming the request's field; a supported one compiles and holds; text that is not JSON keeps
xgrammar's own error.
"""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from kvshard.sampling_params import StructuredOutputsParams as SO
from kvshard.structured.json_schema import REFUSED, check_json_schema
from kvshard.structured.manager import StructuredOutputManager
from kvshard.structured.xgrammar_backend import MAX_WHITESPACE, json_schema_grammar

I = {"type": "integer"}
S = {"type": "string"}


def obj(properties: dict, required: list | None = None, **more) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **more}


# (id, schema, where the check says the form is, words its message holds, an output xgrammar takes that breaks
# the schema)
REFUSED_CASES = [
    ("allOf-of-two", {"allOf": [obj({"a": I}, additionalProperties=False), obj({"b": I})]}, "allOf",
     "allOf with 2 schemas is not supported", "-2E20614900007000"),
    ("allOf-impossible", {"allOf": [S, I]}, "allOf", "allOf with 2 schemas", "12"),
    ("allOf-nested", obj({"x": {"allOf": [S, {"minLength": 2}]}}), "properties.x.allOf", "allOf", '{"x": 5}'),
    ("allOf-empty", {"allOf": []}, "allOf", "allOf with 0 schemas", "1"),
    ("ref-remote", {"$ref": "http://example.com/x.json"}, "$ref",
     "$ref 'http://example.com/x.json' is not supported: only references inside the schema", "true"),
    ("ref-anchor", {"$defs": {"A": {"$anchor": "a", "type": "string"}}, **obj({"x": {"$ref": "#a"}})},
     "properties.x.$ref", "$ref '#a' is not supported", '{"x": 1}'),
    ("dynamicRef", {"$defs": {"A": S}, **obj({"x": {"$dynamicRef": "#/$defs/A"}})}, "properties.x.$dynamicRef",
     "$dynamicRef is not supported", '{"x": 1}'),
    ("required-undefined", {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
     "required", "required names 'a', which properties does not define (and additionalProperties is false)",
     "{}"),
    ("required-undefined-strict", {"type": "object", "required": ["a"]}, "required",
     "required names 'a', which properties does not define", "{}"),
    ("required-undefined-open", {"type": "object", "properties": {}, "required": ["a"],
                                 "additionalProperties": True}, "required", "required names 'a'", "{}"),
    ("not", obj({"n": {"type": "integer", "not": {"const": 3}}}), "properties.n.not", "'not' is not supported",
     '{"n": 3}'),
    ("if-then", {**obj({"a": I, "b": S}, required=["a"]), "if": {"properties": {"a": {"const": 1}}},
                 "then": {"required": ["b"]}}, "if", "if/then/else is not supported", '{"a": 1}'),
    ("dependentRequired", {"type": "object", "properties": {"a": I, "b": I}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", "'dependentRequired' is not supported", '{"a": 1}'),
    ("dependentSchemas", {"type": "object", "properties": {"a": I, "b": I},
                          "dependentSchemas": {"a": {"required": ["b"]}}},
     "dependentSchemas", "'dependentSchemas' is not supported", '{"a": 1}'),
    ("dependencies", {"type": "object", "properties": {"a": I, "b": I}, "dependencies": {"a": ["b"]}},
     "dependencies", "'dependencies' is not supported", '{"a": 1}'),
    ("contains", {"type": "array", "items": I, "contains": {"const": 3}}, "contains",
     "'contains' is not supported", "[1, 2]"),
    ("uniqueItems", {"type": "array", "items": I, "uniqueItems": True}, "uniqueItems",
     "'uniqueItems' is not supported", "[1, 1]"),
    ("multipleOf-number", {"type": "number", "multipleOf": 0.5}, "multipleOf", "'multipleOf' of a number", "1.3"),
    ("multipleOf-fraction", {"type": "integer", "multipleOf": 1.5}, "multipleOf", "'multipleOf': 1.5", "4"),
    ("multipleOf-large", {"type": "integer", "multipleOf": 2048}, "multipleOf", "at most 1024", "7"),
    ("multipleOf-one-bound", {"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf",
     "only a minimum or only a maximum", "7"),
    ("multipleOf-wide-range", {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10000}, "multipleOf",
     "more than 10000 integers", "7"),
    ("pattern-and-length", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength",
     "'pattern' together with minLength/maxLength", '"abcdef"'),
    ("format-and-length", {"type": "string", "format": "uri", "minLength": 1, "maxLength": 12}, "minLength",
     "'format': 'uri' together with minLength/maxLength", '"http://example.com/a/long/path"'),
    ("format-and-pattern", {"type": "string", "format": "email", "pattern": "^z"}, "pattern",
     "'pattern' together with 'format': 'email'", '"a@b.co"'),
    ("lookahead", {"type": "string", "pattern": "^(?!b)[a-z]$"}, "pattern", "a lookahead in the pattern", '"b"'),
    ("lookahead-in-names", {"type": "object", "propertyNames": {"pattern": "^(?!b)[a-z]$"},
                            "additionalProperties": I}, "propertyNames.pattern", "a lookahead", '{"b": 1}'),
    ("untyped-minLength", {"minLength": 2}, "minLength", "'minLength' without \"type\"", '"a"'),
    ("untyped-minimum", obj({"n": {"minimum": 2}}), "properties.n.minimum", "'minimum' without \"type\"",
     '{"n": 1}'),
    ("type-beside-ref", {"$defs": {"X": {"anyOf": [S, I]}}, **obj({"x": {"$ref": "#/$defs/X", "type": "string"}})},
     "properties.x.type", "'type' beside '$ref' is not supported", '{"x": 1}'),
    ("properties-beside-ref", {"$defs": {"X": obj({"a": I})},
                               **obj({"x": {"$ref": "#/$defs/X", "properties": {"b": I}, "required": ["b"]}})},
     "properties.x.properties", "'properties' beside '$ref'", '{"x": {"a": 1}}'),
    ("type-beside-anyOf", {"type": "object", "properties": {"a": I, "b": I},
                           "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "type",
     "'type' beside 'anyOf' is not supported", '{"a": "x"}'),
    ("properties-beside-allOf", {"type": "object", "properties": {"b": I}, "required": ["b"],
                                 "allOf": [obj({"a": I})]}, "properties", "'properties' beside 'allOf'",
     '{"a": 1}'),
    ("minLength-beside-enum", {"enum": ["a", "bb"], "minLength": 2}, "minLength", "'minLength' beside 'enum'",
     '"a"'),
    ("type-beside-enum", {"enum": ["a", 1], "type": "string"}, "type", "'type' beside 'enum'", "1"),
    ("enum-beside-const", {"const": "a", "enum": ["b"]}, "enum", "'enum' beside 'const'", '"a"'),
    ("oneOf-overlapping", {"oneOf": [I, {"type": "number"}]}, "oneOf", "oneOf whose branches may overlap", "1"),
    ("oneOf-objects", {"oneOf": [obj({"x": I}, required=[]), obj({"y": I}, required=[])]}, "oneOf",
     "oneOf whose branches may overlap", "{}"),
    ("anyOf-empty", obj({"a": {"anyOf": []}}), "properties.a.anyOf", "anyOf with no schema", '{"a": }'),
    ("patternProperties-several", {"type": "object", "patternProperties": {
        "^a$": I, "^a.*$": {"type": "integer", "minimum": 5}}}, "patternProperties",
     "several patterns of different schemas", '{"a": 1}'),
    ("patternProperties-beside-properties", {"type": "object", "properties": {"x_a": {"type": "integer", "minimum": 0}},
                                             "patternProperties": {"^x_[a-z]+$": {"type": "integer", "maximum": 5}}},
     "patternProperties", "patternProperties beside properties", '{"x_a": 9}'),
    ("patternProperties-and-propertyNames", {"type": "object", "patternProperties": {"^x_[a-z]+$": I},
                                             "propertyNames": {"maxLength": 3}}, "propertyNames",
     "propertyNames beside patternProperties", '{"x_abcd": 1}'),
    ("propertyNames-beside-properties", {"type": "object", "properties": {"abc": I},
                                         "propertyNames": {"maxLength": 2}}, "propertyNames",
     "propertyNames beside properties", '{"abc": 1}'),
    ("propertyNames-closed", {"type": "object", "propertyNames": {"enum": ["a", "b"]},
                              "additionalProperties": False}, "propertyNames",
     "propertyNames with additionalProperties false", '{"a": 1}'),
]

# (id, schema, outputs that fit it, outputs that do not): the check passes and xgrammar enforces it
DISCRIMINATED = {"$defs": {"Cat": {"type": "object", "title": "Cat", "required": ["pet_type", "meows"],
                                   "properties": {"pet_type": {"const": "cat", "type": "string"}, "meows": I}},
                           "Dog": {"type": "object", "title": "Dog", "required": ["pet_type", "barks"],
                                   "properties": {"pet_type": {"const": "dog", "type": "string"},
                                                  "barks": {"type": "number"}}}},
                 "type": "object", "required": ["pet"],
                 "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                        "discriminator": {"propertyName": "pet_type"}, "title": "Pet"}}}
ANNOTATED = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/p.json",
             "title": "P", "description": "d", "$comment": "c", "examples": [{"a": 1}], "default": {"a": 1},
             "type": "object", "required": ["a"],
             "properties": {"a": {"type": "integer", "title": "A", "description": "an a", "default": 1,
                                  "examples": [1], "deprecated": False, "readOnly": True, "$comment": "c"}}}
SUPPORTED_CASES = [
    ("annotations", ANNOTATED, ['{"a": 1}'], ['{"a": "x"}', "{}"]),
    ("allOf-of-one", {"description": "d", "allOf": [obj({"a": I})]}, ['{"a": 1}'], ["1", "{}"]),
    ("anyOf", {"anyOf": [S, I]}, ['"x"', "1"], ["true"]),
    ("oneOf-types", {"oneOf": [{"type": "string", "minLength": 1}, I]}, ['"a"', "1"], ['""', "true"]),
    ("oneOf-consts", {"oneOf": [{"const": 1}, {"const": 2}]}, ["1", "2"], ["3"]),
    ("oneOf-discriminated-refs", DISCRIMINATED, ['{"pet": {"pet_type": "cat", "meows": 1}}'],
     ['{"pet": {"pet_type": "cat", "barks": 1}}']),
    ("ref-defs", {"$defs": {"X": obj({"a": I})}, **obj({"x": {"$ref": "#/$defs/X", "description": "d"}})},
     ['{"x": {"a": 1}}'], ['{"x": 1}']),
    ("ref-definitions", {"definitions": {"X": S}, **obj({"x": {"$ref": "#/definitions/X"}})}, ['{"x": "s"}'],
     ['{"x": 1}']),
    ("ref-recursive", {"type": "object", "required": ["v", "next"],
                       "properties": {"v": I, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
     ['{"v": 1, "next": {"v": 2, "next": null}}'], ['{"v": 1, "next": 3}']),
    ("const-and-enum-typed", obj({"c": {"const": "a", "type": "string"}, "e": {"enum": ["x", "y"], "type": "string"},
                                  "n": {"enum": ["x", None], "type": ["string", "null"]}}),
     ['{"c": "a", "e": "y", "n": null}'], ['{"c": "b", "e": "y", "n": null}']),
    ("type-beside-anyOf-that-fits", {"type": "object", "anyOf": [obj({"a": I}), obj({"b": I})]},
     ['{"a": 1}'], ["1", '{"a": "x"}']),
    ("arrays", {"type": "array", "prefixItems": [I, S], "items": False, "minItems": 1}, ['[1, "a"]', "[1]"],
     ["[]", '[1, "a", 2]']),
    ("items-and-lengths", {"type": "array", "items": I, "minItems": 1, "maxItems": 2}, ["[1]"], ["[]", "[1, 2, 3]"]),
    ("contains-minContains-0", {"type": "array", "items": I, "contains": {"const": 3}, "minContains": 0},
     ["[]", "[1]"], ['["a"]']),
    ("strings", obj({"s": {"type": "string", "minLength": 2, "maxLength": 3}, "p": {"type": "string",
                                                                                 "pattern": "^[a-z]+$"},
                     "f": {"type": "string", "format": "date"}}),
     ['{"s": "ab", "p": "x", "f": "2024-01-02"}'], ['{"s": "a", "p": "x", "f": "2024-01-02"}',
                                                    '{"s": "ab", "p": "x1", "f": "2024-01-02"}',
                                                    '{"s": "ab", "p": "x", "f": "soon"}']),
    ("format-as-annotation", {"type": "string", "format": "binary", "maxLength": 3}, ['"abc"'], ['"abcd"']),
    ("numbers", obj({"i": {"type": "integer", "minimum": 1, "exclusiveMaximum": 5},
                     "m": {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 20},
                     "u": {"type": "integer", "multipleOf": 4}, "x": {"type": "number", "maximum": 2.5}}),
     ['{"i": 4, "m": 6, "u": 8, "x": 1.5}'],
     ['{"i": 5, "m": 6, "u": 8, "x": 1.5}', '{"i": 4, "m": 7, "u": 8, "x": 1.5}',
      '{"i": 4, "m": 6, "u": 6, "x": 1.5}', '{"i": 4, "m": 6, "u": 8, "x": 3}']),
    ("objects", {"type": "object", "properties": {"a": I}, "required": ["a"], "additionalProperties": S,
                 "maxProperties": 2}, ['{"a": 1, "b": "x"}'], ['{"a": 1, "b": 2}', '{"a": 1, "b": "x", "c": "y"}']),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": I}, "unevaluatedProperties": False},
     ['{"a": 1}'], ['{"a": 1, "b": 2}']),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_[a-z]+$": I}, "minProperties": 1},
     ['{"x_a": 1}'], ["{}", '{"x_a": "s"}']),
    ("propertyNames", {"type": "object", "propertyNames": {"enum": ["a", "b"]}, "additionalProperties": I},
     ['{"a": 1}'], ['{"c": 1}', '{"a": "s"}']),
    ("type-array", {"type": ["string", "null"], "maxLength": 2}, ['"ab"', "null"], ['"abc"', "1"]),
    ("empty-dependentRequired", {"type": "object", "properties": {"a": I}, "required": ["a"],
                                 "dependentRequired": {}}, ['{"a": 1}'], ["{}"]),
]


def kvshard_grammar(schema):
    """The grammar the backend compiles for this schema (strict mode, bounded whitespace)."""
    return json_schema_grammar(xgrammar, json.dumps(schema), dict(any_whitespace=True,
                                                                  max_whitespace_cnt=MAX_WHITESPACE))


@pytest.mark.parametrize("schema, path, words, _", [c[1:] for c in REFUSED_CASES], ids=[c[0] for c in REFUSED_CASES])
def test_a_form_xgrammar_does_not_enforce_is_refused_where_it_is(schema, path, words, _):
    with pytest.raises(ValueError) as raised:
        check_json_schema(schema)
    message = str(raised.value)
    assert words in message and message.endswith(f" (at {path})"), message


@pytest.mark.parametrize("schema, broken", [(c[1], c[4]) for c in REFUSED_CASES], ids=[c[0] for c in REFUSED_CASES])
def test_xgrammar_lets_through_an_output_that_breaks_each_refused_schema(schema, broken):
    """The evidence for each refusal: xgrammar 0.2.8 compiles the schema (with a warning, or none) and takes
    an output the schema does not allow."""
    assert _is_grammar_accept_string(kvshard_grammar(schema), broken)


@pytest.mark.parametrize("schema, good, bad", [c[1:] for c in SUPPORTED_CASES], ids=[c[0] for c in SUPPORTED_CASES])
def test_a_form_xgrammar_enforces_passes_and_holds(schema, good, bad):
    check_json_schema(schema)
    grammar = kvshard_grammar(schema)
    for text in good:
        assert _is_grammar_accept_string(grammar, text), text
    for text in bad:
        assert not _is_grammar_accept_string(grammar, text), text


def test_every_refused_form_is_tested():
    forms = set()
    for _, schema, _, _, _ in REFUSED_CASES:
        with pytest.raises(ValueError) as raised:
            check_json_schema(schema)
        forms |= {form for form, words in REFUSED.items()
                  if re.fullmatch(re.sub(r"\\\{[^}]*\\\}", ".*", re.escape(words)) + r" \(at .*\)", str(raised.value))}
    assert forms == set(REFUSED), set(REFUSED) - forms


def test_a_large_oneof_is_proven_disjoint_or_refused():
    """Branches of distinct const values, or objects tagged by a required const property, are disjoint (told
    in linear time); many branches that only a pairwise proof could tell apart are refused."""
    check_json_schema({"oneOf": [{"const": i} for i in range(5000)]})
    check_json_schema({"oneOf": [obj({"kind": {"const": f"k{i}"}, "v": I}) for i in range(5000)]})
    with pytest.raises(ValueError, match=r"oneOf whose branches may overlap .* \(at oneOf\)$"):
        check_json_schema({"oneOf": [{"const": 1}, {"const": 1.0}]})  # equal in JSON
    with pytest.raises(ValueError, match=r"oneOf whose branches may overlap"):
        check_json_schema({"oneOf": [obj({"kind": {"const": f"k{i % 4000}"}}) for i in range(5000)]})


def test_the_repository_schemas_pass():
    """The structured-output tests' schemas, the agentic tests' (pydantic models, the openai SDK's strict tool
    schemas, the tool-call constraints kvshard builds) and pydantic's common types."""
    import enum
    import uuid
    from datetime import datetime
    from typing import Literal, Optional, Union

    import openai
    from pydantic import BaseModel, Field
    from test_agentic_api import SCHEMAS, SDK_TOOLS, TOOLS, WEATHER
    from test_structured_outputs import BOUNDED_SCHEMA, SCHEMA

    from kvshard.entrypoints.openai.protocol import ChatTool
    from kvshard.entrypoints.openai.serving_chat import tool_constraint

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        barks: float

    class Color(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Everything(BaseModel):
        pet: Union[Cat, Dog] = Field(discriminator="pet_type")
        maybe: Optional[Cat] = None
        color: Color = Color.red
        data: bytes
        when: datetime
        id: uuid.UUID
        counts: dict[str, int]
        pair: tuple[int, str]
        step: int = Field(multiple_of=5, ge=0, le=100)
        name: str = Field(pattern="^[a-z]+$")
        either: Union[int, str]

    tools = [ChatTool.model_validate(tool) for tool in TOOLS]
    schemas = [SCHEMA, BOUNDED_SCHEMA, WEATHER, Everything.model_json_schema(),
               *(model.model_json_schema() for model, _ in SCHEMAS),
               *(openai.pydantic_function_tool(model)["function"]["parameters"] for model, _ in SCHEMAS),  # strict
               *(tool["function"]["parameters"] for tool in SDK_TOOLS),
               *(tool_constraint(tools, "required", None, parallel).json for parallel in (False, True)),
               tool_constraint(tools, "named", "get_weather", False).json]
    for schema in schemas:
        check_json_schema(schema)
        kvshard_grammar(schema)  # and xgrammar compiles it


# --- the backend's compile path -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manager():
    """The compile path of the engine, on the demo models' byte-level tokenizer (trained here, no weights)."""
    from kvshard.models.demo import train_tokenizer

    tokenizer = train_tokenizer(512)
    made = StructuredOutputManager(tokenizer, 512, [tokenizer.eos_token_id])
    yield made
    made.shutdown()


ALL_OF = {"type": "object", "properties": {"x": {"allOf": [S, I]}}, "required": ["x"]}


def test_the_compile_path_refuses_a_schema_and_the_server_answers_400(manager):
    from kvshard.entrypoints.openai.protocol import APIError
    from kvshard.entrypoints.openai.serving_engine import ServingBase

    expected = ("structured_outputs.json could not be compiled: allOf with 2 schemas is not supported: xgrammar "
                "enforces an allOf of exactly one schema (at properties.x.allOf)")
    for schema in (ALL_OF, json.dumps(ALL_OF)):  # a dict, or its text
        with pytest.raises(ValueError) as raised:
            manager.check(SO(json=schema))
        assert str(raised.value) == expected
    with pytest.raises(ValueError, match=re.escape("$ref 'http://example.com/x.json' is not supported")):
        manager.check(SO(json={"$ref": "http://example.com/x.json"}))
    # the OpenAI layer: a 400 naming the request's field, in the engine's words
    serving = SimpleNamespace(check_structured_outputs=manager.check)
    field = "response_format.json_schema.schema"
    with pytest.raises(APIError) as raised:
        asyncio.run(ServingBase._check_constraint(serving, SO(json=ALL_OF), field))
    assert raised.value.status == 400 and raised.value.param == field
    assert raised.value.message == field + expected.removeprefix("structured_outputs.json")
    # a supported schema compiles, and its grammar holds
    tokenizer = manager.tokenizer
    grammar = manager.new_grammar(manager.check(SO(json={"type": "object", "properties": {"x": {"allOf": [I]}},
                                                         "required": ["x"]})))
    for token in tokenizer.encode('{"x": 12}', add_special_tokens=False):
        assert grammar.accept_token(token)
    assert grammar.accept_token(tokenizer.eos_token_id) and grammar.is_terminated()
    # text that is not JSON (past StructuredOutputsParams' own check) keeps xgrammar's error
    params = SimpleNamespace(kind=lambda: "json", json='{"type": ', disable_any_whitespace=False)
    with pytest.raises(ValueError, match=r"^structured_outputs\.json could not be compiled: (?!.*not supported)"):
        manager.backend.compile(params)
