"""The JSON-schema forms the xgrammar backend does not enforce, refused before a schema is compiled.

xgrammar 0.2.8 (pinned in pyproject.toml) compiles some schema forms without enforcing them: it logs a C++
warning, or nothing, and the grammar lets through output that breaks the schema (`{"allOf": [A, B]}` becomes
any JSON value, `"not"` is dropped, ...). `check_json_schema` walks a schema the way xgrammar reads it and
raises a ValueError naming the first such form and where it is ("... (at properties.x.allOf)"), so that the
constraint that is compiled is the one the request asked for. `REFUSED` below lists every refused form with
what xgrammar does with it; tests/test_structured_schema_support.py compiles each with xgrammar and shows it.

What xgrammar does enforce passes: type (and type arrays), properties / required / additionalProperties /
unevaluatedProperties / minProperties / maxProperties, items / prefixItems / unevaluatedItems / minItems /
maxItems, minimum / maximum / exclusive bounds, multipleOf of an integer over a bounded range, minLength /
maxLength, pattern, the formats in `KNOWN_FORMATS`, const, enum, anyOf, allOf of one schema, oneOf whose
branches are disjoint, local $ref ("#", "#/$defs/...", recursion included), patternProperties of one schema
without properties beside, propertyNames without properties beside. Annotations (title, description, examples, default, $schema, $id, $comment, ...) and keywords
unknown to JSON Schema (discriminator, nullable, x-...) are ignored, as a validator ignores them; so is a
`format` xgrammar does not know (formats are annotations by default in JSON Schema 2019-09 and later: pydantic
writes "binary", "password", "path"...). What xgrammar makes stricter than the schema (a pattern matched whole,
objects without undeclared properties in strict mode) is not refused: the output still fits the schema.
"""

from __future__ import annotations

import json
import math
import re

# Each refused form: the message (said of the schema, then " (at PATH)"), and, in the comment before it, what
# xgrammar 0.2.8 does with it (compiled with strict_mode=True).
REFUSED = {
    # warns "Support for allOf with multiple options is still ongoing" and allows any JSON value (`{"allOf":
    # [{"type": "string"}, {"type": "integer"}]}` takes `12`); an allOf of one schema is that schema
    "allOf": "allOf with {count} schemas is not supported: xgrammar enforces an allOf of exactly one schema",
    # warns "URI should either be '#' or start with '#/'" and allows any JSON value
    "$ref": "$ref {uri!r} is not supported: only references inside the schema ('#' or '#/...')",
    # silently ignored (no grammar rule)
    "$dynamicRef": "{keyword} is not supported: xgrammar ignores it",
    # silently ignored: `{"not": {"type": "string"}}` takes `"x"`
    "not": "'not' is not supported: xgrammar ignores it",
    # silently ignored: the "then" schema is never applied
    "if": "if/then/else is not supported: xgrammar ignores it",
    # silently ignored: `{"dependentRequired": {"a": ["b"]}}` takes `{"a": 1}`
    "dependentRequired": "{keyword!r} is not supported: xgrammar ignores it",
    # silently ignored: `[1, 2]` passes `"contains": {"const": 3}` (minContains is read as minItems); a contains
    # with minContains 0 (and no maxContains) holds of every array and passes
    "contains": "'contains' is not supported: xgrammar ignores it",
    # silently ignored: `[1, 1]` passes
    "uniqueItems": "'uniqueItems' is not supported: xgrammar ignores it",
    # warns "multipleOf is not supported for type:number; ignoring multipleOf"
    "multipleOf/number": "'multipleOf' of a number is not supported: xgrammar ignores it (it holds for integers)",
    # warns "multipleOf for type:integer must be an integer" / "... must be > 0 and <= 1024"; "range +
    # multipleOf combination not yet supported" with one bound only or more than 10000 integers between the two
    "multipleOf/integer": "'multipleOf': {value} of an integer is not supported: xgrammar ignores it {why}",
    # warns "pattern combined with minLength/maxLength is not supported; ignoring minLength/maxLength", and
    # "format combined with minLength/maxLength ..." for a format of KNOWN_FORMATS
    "length": "{other} together with minLength/maxLength is not supported: xgrammar ignores the lengths",
    # silently ignored: a format of KNOWN_FORMATS wins, `"pattern": "^z"` beside `"format": "email"` takes "a@b.co"
    "format+pattern": "'pattern' together with 'format': {format!r} is not supported: xgrammar ignores the pattern",
    # warns "Lookahead assertion is not supported and is ignored in regex" (lookbehind is a compile error), in
    # a pattern, a patternProperties pattern or a propertyNames pattern
    "lookahead": "a lookahead in the pattern {pattern!r} is not supported: xgrammar ignores it",
    # silently wrong: an empty anyOf / oneOf is written as nothing, `{"a": }` (not JSON)
    "empty": "{keyword} with no schema is not supported: xgrammar writes no value for it",
    # silently ignored: a keyword of one type in a schema without "type" (nor properties, items...) is dropped,
    # `{"minLength": 2}` takes `"a"`
    "untyped": "{keyword!r} without \"type\" is not supported: xgrammar applies it only beside \"type\": {type!r}",
    # silently ignored: beside $ref, const, enum, anyOf, oneOf or allOf, xgrammar reads that keyword alone
    # (in this order) and drops the others: `{"type": "object", "properties": {...}, "anyOf": [...]}` takes
    # objects that break the properties. Allowed: "type" that every value / branch has anyway
    "sibling": "{keyword!r} beside {used!r} is not supported: xgrammar applies only the {used!r} there",
    # silently dropped: only a name of "properties" is ever required (`{}` passes `"required": ["a"]`)
    "required": "required names {names}, which properties does not define {why}",
    # warns "oneOf with overlapping or non-provably-disjoint branches cannot be represented exactly; falling
    # back to anyOf semantics": an output that two branches take passes. Refused where kvshard cannot show the
    # branches disjoint (by type, by const/enum values, or by the const/enum values of a required property)
    "oneOf": ("oneOf whose branches may overlap is not supported: xgrammar enforces it as anyOf; make the "
              "branches disjoint (different types, or different const/enum values of a required property) "
              "or use anyOf"),
    # silently wrong: a name one pattern matches takes that pattern's schema only, not every matching one's
    "patternProperties/several": ("patternProperties with several patterns of different schemas is not "
                                  "supported: xgrammar applies one pattern's schema to a name several match"),
    # silently wrong beside properties: a property whose name a pattern matches takes its own schema only (and
    # may come twice, `{"x_a": "s", "x_a": 1}`), and with additionalProperties any name may take that schema
    "patternProperties/properties": ("patternProperties beside properties is not supported: xgrammar does not "
                                     "apply the patterns to the names of properties"),
    # silently ignored: the patterns alone decide the names
    "patternProperties/propertyNames": ("propertyNames beside patternProperties is not supported: xgrammar "
                                        "ignores the propertyNames"),
    # silently wrong: the names of "properties" are not checked against propertyNames
    "propertyNames/properties": ("propertyNames beside properties is not supported: xgrammar does not check "
                                 "the names of properties against it"),
    # silently wrong: properties of those names are written although no other property is allowed
    "propertyNames/closed": ("propertyNames with {keyword} false is not supported: xgrammar still writes "
                             "properties of those names"),
}

# the formats xgrammar 0.2.8 writes as a regular expression; it ignores any other (an annotation)
KNOWN_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                           "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
MULTIPLE_OF_MAX = 1024  # xgrammar's cap on an integer's multipleOf
MULTIPLE_OF_RANGE_MAX = 10000  # ... and on the number of integers between its bounds

# the keywords of JSON Schema (2020-12, and draft 7's) that constrain a value; any other is an annotation or
# unknown, which a validator ignores as xgrammar does
ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
    "maxProperties", "minProperties", "required", "dependentRequired", "dependencies", "properties",
    "patternProperties", "additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "contains", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "dependentSchemas", "$ref", "$dynamicRef", "$recursiveRef"})
IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef",
           "$recursiveRef")  # refused wherever they are (their own message)
# xgrammar reads the first of these that a schema holds, alone
DISPATCH = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# the keywords that constrain one type only, by that type; xgrammar applies them beside that "type" (or beside
# properties / items..., which make a schema without "type" an object / array)
TYPED = {"minLength": "string", "maxLength": "string", "pattern": "string",
         "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
         "multipleOf": "number", "minItems": "array", "maxItems": "array", "uniqueItems": "array",
         "contains": "array", "required": "object", "minProperties": "object", "maxProperties": "object",
         "patternProperties": "object", "propertyNames": "object"}
OBJECT_KEYWORDS = ("properties", "additionalProperties", "unevaluatedProperties")
ARRAY_KEYWORDS = ("items", "prefixItems", "unevaluatedItems")
_LOOKAHEAD = re.compile(r"\(\?[=!]")
_MAX_REF_DEPTH = 64
ONE_OF_PAIRS_MAX = 256  # a oneOf of more branches is proven disjoint in linear time or refused


def check_json_schema(schema) -> None:
    """Raise ValueError naming the first form of `schema` (a parsed JSON schema) that xgrammar would compile
    without enforcing, and where it is. A schema xgrammar cannot read at all is left to its compiler."""
    _Checker(schema).run()


def _refuse(form: str, path: tuple, **words) -> ValueError:
    where = ".".join(map(str, path))
    return ValueError(f"{REFUSED[form].format(**words)} (at {where})")


def _types_of(value) -> set[str]:
    """The JSON types a value has ("integer" a number with no fraction is both)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"integer", "number"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    return {"object"}


def _fits(types: set[str], allowed: set[str]) -> bool:
    """Whether a value of one of `types` (a set from _types_of, or a schema's) is of a type in `allowed`."""
    return bool(types & allowed) or ("integer" in types and "number" in allowed)


def _overlap(one: set[str], other: set[str]) -> bool:
    numeric = {"integer", "number"}
    return bool(one & other) or bool(one & numeric and other & numeric)


def _type_set(schema: dict) -> set[str] | None:
    """The "type" keyword as a set (None: none given, or one xgrammar reads as none)."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list) and declared and all(isinstance(t, str) for t in declared):
        return set(declared)
    return None


class _Shape:
    """What a schema allows, as far as the oneOf proof needs: its types (None: any), its values (None: not a
    finite set; else by _canonical text) and, for an object, the values of each required property that has
    finitely many (by property name)."""

    def __init__(self, types: set[str] | None = None, values: dict | None = None) -> None:
        self.types = types
        self.values = values
        self.tags: dict[str, set[str]] = {}


class _Checker:
    def __init__(self, root) -> None:
        self.root = root
        self.walked_refs: set[str] = set()

    def run(self) -> None:
        stack = [(self.root, (), None)]
        while stack:
            node, path, default_type = stack.pop()
            children = self.check(node, path, default_type)
            stack.extend(reversed(children))

    # --- references -----------------------------------------------------------------------------
    def resolve(self, uri: str):
        """The schema a local $ref names, or None (xgrammar reports a missing one itself)."""
        if uri == "#":
            return self.root
        node = self.root
        for part in uri[2:].split("/"):
            if not part:
                continue
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    @staticmethod
    def ref_path(uri: str) -> tuple:
        return tuple(part for part in uri[2:].split("/") if part) if uri != "#" else ()

    # --- one schema ---------------------------------------------------------------------------------
    def check(self, node, path: tuple, default_type: str | None) -> list:
        """Refuse what xgrammar would not enforce in this schema object; the subschemas it reads, to check."""
        if not isinstance(node, dict):
            return []  # true / false, or not a schema (xgrammar's own error)
        for keyword in IGNORED:
            if keyword in node:
                if node[keyword] in ({}, []) and keyword not in ("not", "if", "then", "else"):
                    continue  # an empty dependentRequired (...) asks for nothing
                if keyword in ("then", "else") and "if" not in node:
                    continue  # without "if", they apply to nothing
                if keyword == "if" and "then" not in node and "else" not in node:
                    continue
                form = {"then": "if", "else": "if", "dependentSchemas": "dependentRequired",
                        "dependencies": "dependentRequired", "$recursiveRef": "$dynamicRef"}.get(keyword, keyword)
                raise _refuse(form, path + (keyword,), keyword=keyword)
        used = next((keyword for keyword in DISPATCH if keyword in node), None)
        if used is not None:
            self.check_siblings(node, path, used)
            return self.check_dispatch(node, path, used)
        return self.check_typed(node, path, default_type)

    def check_siblings(self, node: dict, path: tuple, used: str) -> None:
        for keyword in node:
            if keyword == used or keyword not in ASSERTIONS or keyword in IGNORED:
                continue
            if keyword == "type" and self.type_holds(node, used):
                continue
            if keyword == "enum" and used == "const" and isinstance(node["enum"], list) and _canonical(
                    node["const"]) in map(_canonical, node["enum"]):
                continue
            raise _refuse("sibling", path + (keyword,), keyword=keyword, used=used)

    def type_holds(self, node: dict, used: str) -> bool:
        """Whether everything the dispatching keyword allows is of the sibling "type" anyway."""
        allowed = _type_set(node)
        if allowed is None:
            return False
        shape = self.shape({k: v for k, v in node.items() if k != "type"}, 0)
        if shape.values is not None:
            return all(_fits(_types_of(value), allowed) for value in shape.values.values())
        return shape.types is not None and all(_fits({t}, allowed) for t in shape.types)

    def check_dispatch(self, node: dict, path: tuple, used: str) -> list:
        value = node[used]
        if used == "$ref":
            if not isinstance(value, str):
                return []  # xgrammar's "$ref must be a string"
            if value != "#" and not value.startswith("#/"):
                raise _refuse("$ref", path + ("$ref",), uri=value)
            target = self.resolve(value)
            if target is None or value in self.walked_refs:
                return []
            self.walked_refs.add(value)
            return [(target, self.ref_path(value), None)]
        if used in ("const", "enum"):
            return []
        if not isinstance(value, list):
            return []  # xgrammar's "... must be an array"
        if used in ("anyOf", "oneOf") and not value:
            raise _refuse("empty", path + (used,), keyword=used)
        if used == "allOf" and len(value) != 1:
            raise _refuse("allOf", path + ("allOf",), count=len(value))
        if used == "oneOf":
            self.check_one_of(value, path + ("oneOf",))
        return [(arm, path + (used, i), None) for i, arm in enumerate(value)]

    def check_typed(self, node: dict, path: tuple, default_type: str | None) -> list:
        types = _type_set(node)
        if types is None and "type" in node and node["type"] != []:
            return []  # not a type xgrammar reads: its own error
        if types is None and default_type is not None and "type" not in node:
            types = {default_type}
        if types is None:
            if any(keyword in node for keyword in OBJECT_KEYWORDS):
                types = {"object"}
            elif any(keyword in node for keyword in ARRAY_KEYWORDS):
                types = {"array"}
            else:
                for keyword, typed in TYPED.items():
                    if keyword in node:
                        raise _refuse("untyped", path + (keyword,), keyword=keyword, type=typed)
                return []
        children: list = []
        if "integer" in types:
            self.check_integer(node, path)
        if "number" in types and "multipleOf" in node:
            raise _refuse("multipleOf/number", path + ("multipleOf",))
        if "string" in types:
            self.check_string(node, path)
        if "array" in types:
            children += self.check_array(node, path)
        if "object" in types:
            children += self.check_object(node, path)
        return children

    # --- by type ------------------------------------------------------------------------------------
    def check_integer(self, node: dict, path: tuple) -> None:
        value = node.get("multipleOf")
        if not _number(value) or not math.isfinite(value) or value <= 0:
            return  # none, or xgrammar's own error
        where = path + ("multipleOf",)
        if value != int(value):
            raise _refuse("multipleOf/integer", where, value=value, why="(a whole number is)")
        if value > MULTIPLE_OF_MAX:
            raise _refuse("multipleOf/integer", where, value=value, why=f"(at most {MULTIPLE_OF_MAX} is)")
        lows = [b for b in (node.get("minimum"), _plus(node.get("exclusiveMinimum"), 1)) if _number(b)]
        highs = [b for b in (node.get("maximum"), _plus(node.get("exclusiveMaximum"), -1)) if _number(b)]
        if not lows and not highs:
            return
        if not lows or not highs:
            raise _refuse("multipleOf/integer", where, value=value,
                          why="beside only a minimum or only a maximum (with both, or neither, it holds)")
        if min(highs) - max(lows) + 1 > MULTIPLE_OF_RANGE_MAX:
            raise _refuse("multipleOf/integer", where, value=value,
                          why=f"over a range of more than {MULTIPLE_OF_RANGE_MAX} integers")

    def check_string(self, node: dict, path: tuple) -> None:
        lengths = node.get("minLength", 0) not in (0, None) or node.get("maxLength") is not None
        fmt = node.get("format")
        known = isinstance(fmt, str) and fmt in KNOWN_FORMATS
        pattern = node.get("pattern")
        if known and pattern is not None:
            raise _refuse("format+pattern", path + ("pattern",), format=fmt)
        if lengths and (known or pattern is not None):
            keyword = "minLength" if node.get("minLength", 0) not in (0, None) else "maxLength"
            other = f"'format': {fmt!r}" if known else "'pattern'"
            raise _refuse("length", path + (keyword,), other=other)
        if isinstance(pattern, str):
            self.check_pattern(pattern, path + ("pattern",))

    @staticmethod
    def check_pattern(pattern: str, path: tuple) -> None:
        if _has_lookahead(pattern):
            raise _refuse("lookahead", path, pattern=pattern)

    def check_array(self, node: dict, path: tuple) -> list:
        if "contains" in node and (node.get("minContains") != 0 or "maxContains" in node):
            raise _refuse("contains", path + ("contains",))
        if node.get("uniqueItems") is True:
            raise _refuse("uniqueItems", path + ("uniqueItems",))
        children = []
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            children += [(item, path + ("prefixItems", i), None) for i, item in enumerate(prefix)]
        if "items" in node:
            children.append((node["items"], path + ("items",), None))
        elif "unevaluatedItems" in node:
            children.append((node["unevaluatedItems"], path + ("unevaluatedItems",), None))
        return children

    def check_object(self, node: dict, path: tuple) -> list:
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        additional = node.get("additionalProperties")
        unevaluated = node.get("unevaluatedProperties")
        # what xgrammar writes besides the named properties: nothing (strict mode) unless one of these allows it
        if "additionalProperties" in node:
            closed, closing = additional is False, "additionalProperties"
        elif "unevaluatedProperties" in node:
            closed, closing = unevaluated is False, "unevaluatedProperties"
        else:
            closed, closing = True, None
        required = node.get("required")
        if isinstance(required, list):
            missing = [name for name in required if isinstance(name, str) and name not in properties]
            if missing:
                if closing is not None and closed:
                    why = f"(and {closing} is false): it cannot be written"
                elif closed:
                    why = "(and the schema allows no other property: kvshard compiles in strict mode)"
                else:
                    why = "(xgrammar requires only the properties that properties defines)"
                raise _refuse("required", path + ("required",), names=", ".join(map(repr, missing)), why=why)
        patterns = node.get("patternProperties")
        patterns = patterns if isinstance(patterns, dict) else {}
        names = node.get("propertyNames")
        if patterns:
            where = path + ("patternProperties",)
            if "propertyNames" in node:
                raise _refuse("patternProperties/propertyNames", path + ("propertyNames",))
            schemas = list(patterns.values())
            if any(json.dumps(s, sort_keys=True) != json.dumps(schemas[0], sort_keys=True) for s in schemas[1:]):
                raise _refuse("patternProperties/several", where)
            for pattern in patterns:
                self.check_pattern(pattern, where + (pattern,))
            if properties:
                raise _refuse("patternProperties/properties", where)
        elif isinstance(names, dict):
            if properties:
                raise _refuse("propertyNames/properties", path + ("propertyNames",))
            if closing is not None and closed:
                raise _refuse("propertyNames/closed", path + ("propertyNames",), keyword=closing)
        children = [(schema, path + ("properties", name), None) for name, schema in properties.items()]
        children += [(schema, path + ("patternProperties", pattern), None) for pattern, schema in patterns.items()]
        if isinstance(names, dict) and not patterns:
            children.append((names, path + ("propertyNames",), "string"))
        if isinstance(additional, dict):
            children.append((additional, path + ("additionalProperties",), None))
        elif "additionalProperties" not in node and isinstance(unevaluated, dict):
            children.append((unevaluated, path + ("unevaluatedProperties",), None))
        return children

    # --- oneOf ----------------------------------------------------------------------------------------
    def check_one_of(self, arms: list, path: tuple) -> None:
        """Refuse unless the branches are pairwise disjoint (linear in the common cases: all branches finite,
        or all objects tagged by one required property)."""
        if len(arms) < 2:
            return
        shapes = [self.shape(arm, 0, tags=True) for arm in arms]
        if all(shape.values is not None for shape in shapes):
            if _disjoint_sets([shape.values.keys() for shape in shapes]):
                return
            raise _refuse("oneOf", path)
        for key in set.intersection(*(set(shape.tags) for shape in shapes)):
            if _disjoint_sets([shape.tags[key] for shape in shapes]):
                return
        if len(arms) > ONE_OF_PAIRS_MAX:
            raise _refuse("oneOf", path)
        for i, one in enumerate(shapes):
            for other in shapes[i + 1:]:
                if not _disjoint(one, other):
                    raise _refuse("oneOf", path)

    def follow(self, node, depth: int):
        """The schema behind a chain of local $refs (None past _MAX_REF_DEPTH or at a missing target)."""
        while isinstance(node, dict) and isinstance(node.get("$ref"), str):
            if depth > _MAX_REF_DEPTH or not (node["$ref"] == "#" or node["$ref"].startswith("#/")):
                return None
            node, depth = self.resolve(node["$ref"]), depth + 1
        return node

    def shape(self, node, depth: int, tags: bool = False) -> _Shape:
        node = self.follow(node, depth)
        if depth > _MAX_REF_DEPTH or node is None or node is True:
            return _Shape()
        if node is False:
            return _Shape(set(), {})
        if not isinstance(node, dict):
            return _Shape()
        if "const" in node:
            return _Shape(_types_of(node["const"]), {_canonical(node["const"]): node["const"]})
        if isinstance(node.get("enum"), list) and node["enum"]:
            values = node["enum"]
            return _Shape(set().union(*map(_types_of, values)), {_canonical(v): v for v in values})
        for keyword in ("anyOf", "oneOf", "allOf"):
            if isinstance(node.get(keyword), list) and node[keyword]:
                arms = [self.shape(arm, depth + 1) for arm in node[keyword]]
                if keyword == "allOf":
                    return arms[0] if len(arms) == 1 else _Shape()
                types = None if any(a.types is None for a in arms) else set().union(*(a.types for a in arms))
                values = None if any(a.values is None for a in arms) else {
                    k: v for a in arms for k, v in a.values.items()}
                return _Shape(types, values)
        shape = _Shape(_type_set(node), None)
        if tags:
            shape.tags = self.tags(node, depth)
        return shape

    def tags(self, node: dict, depth: int) -> dict[str, set[str]]:
        """An object schema's required properties of finitely many values: their values, by name. Only for a
        schema xgrammar writes as objects alone ("type": "object", or properties without a "type")."""
        objects = _type_set(node) == {"object"} or ("type" not in node and any(k in node for k in OBJECT_KEYWORDS))
        required, properties = node.get("required"), node.get("properties")
        if not objects or not isinstance(required, list) or not isinstance(properties, dict):
            return {}
        found = {}
        for key in required:
            if isinstance(key, str) and key in properties:
                values = self.shape(properties[key], depth + 1).values
                if values is not None:
                    found[key] = set(values)
        return found


def _disjoint(one: _Shape, other: _Shape) -> bool:
    """Whether no value is valid under both schemas (a proof; False when it cannot tell)."""
    if one.values is not None and other.values is not None:
        return not one.values.keys() & other.values.keys()
    if one.values is not None and other.types is not None:  # one.types: the types of its values
        return not _fits(one.types, other.types)
    if other.values is not None and one.types is not None:
        return not _fits(other.types, one.types)
    if one.types is not None and other.types is not None and not _overlap(one.types, other.types):
        return True
    return any(not one.tags[key] & other.tags[key] for key in one.tags.keys() & other.tags.keys())


def _disjoint_sets(sets: list) -> bool:
    seen: set = set()
    for values in sets:
        if not seen.isdisjoint(values):
            return False
        seen.update(values)
    return True


def _canonical(value) -> str:
    """The JSON text of a value, equal for values JSON Schema calls equal (1 and 1.0, objects in any order)."""
    def normal(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [normal(x) for x in v]
        if isinstance(v, dict):
            return {k: normal(x) for k, x in v.items()}
        return v
    return json.dumps(normal(value), sort_keys=True)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plus(value, step: int):
    return value + step if _number(value) else None


def _has_lookahead(pattern: str) -> bool:
    """Whether the regex holds a lookahead group (outside character classes, not escaped)."""
    i, in_class = 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(" and _LOOKAHEAD.match(pattern, i):
            return True
        i += 1
    return False

