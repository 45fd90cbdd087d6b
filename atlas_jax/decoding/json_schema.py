"""JSON schema -> regular expression, for guided decoding (`atlas_jax.decoding.guided`).

Every match of the regex is a JSON text that validates against the schema: each keyword accepted
here is enforced, and any other one raises `SchemaError` naming it (outlines-core's own converter
ignores `minimum`, concatenates `allOf` and reads `oneOf` as `anyOf`, so its matches can fail
their schema). Objects list their properties in the declared order, optional ones may be left out.

Whitespace between JSON tokens is bounded (at most one space after `:` and `,`), so a bounded
schema has a bounded longest output. Numbers have at most 16 integer digits, 16 fraction digits
and a 3-digit exponent (beyond a float64's precision). Strings are unbounded unless the schema
sets `maxLength`; generic JSON (`{}`, an object without properties) nests two levels deep.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

# The one space allowed after ':' and ',' (json.dumps writes one; compact JSON none).
WS = "[ ]?"
# A character of a JSON string: anything but a quote, a backslash or a control character, or a
# short escape. (\uXXXX escapes are valid JSON that this never writes.)
STRING_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]{0,15})"
NUMBER = INTEGER + r"(?:\.[0-9]{1,16})?(?:[eE][+-]?[0-9]{1,3})?"
BOOLEAN = "(?:true|false)"
NULL = "null"
GENERIC_DEPTH = 1  # generic JSON values: containers nest GENERIC_DEPTH + 1 levels
MAX_REF_DEPTH = 3  # how often a recursive $ref may nest before its optional branches are cut
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-][0-9]{2}:[0-9]{2})"
_FORMATS = {
  "date": f'"{_DATE}"',
  "time": f'"{_TIME}"',
  "date-time": f'"{_DATE}T{_TIME}"',
  "uuid": r'"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"',
}
# Keywords that constrain nothing: skipped wherever they appear.
_ANNOTATIONS = set(
  "title description default examples $schema $id $comment $defs definitions deprecated "
  "readOnly writeOnly discriminator".split()
)
_TYPE_KEYWORDS = {
  "string": {"minLength", "maxLength", "format"},
  "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
  "number": set(),
  "boolean": set(),
  "null": set(),
  "array": {"items", "prefixItems", "minItems", "maxItems"},
  "object": {"properties", "required", "additionalProperties"},
}


class SchemaError(ValueError):
  """A schema that cannot be turned into a regex; `path` is where in it (".properties.age")."""

  def __init__(self, path: str, message: str):
    super().__init__(f"{path or '<root>'}: {message}")
    self.path, self.message = path, message


_META = set("\\.+*?()|[]{}^$#&-~")


def regex_escape(text: str) -> str:
  """`text` as a regex matching exactly it (Rust `regex` syntax, as outlines-core reads it)."""
  out = []
  for ch in text:
    if ch in _META:
      out.append("\\" + ch)
    elif ord(ch) < 0x20 or ord(ch) == 0x7F:
      out.append(f"\\x{{{ord(ch):x}}}")
    else:
      out.append(ch)
  return "".join(out)


def choice_regex(choices: Sequence[str]) -> str:
  return "(?:" + "|".join(regex_escape(c) for c in choices) + ")"


def _json_literal(value: Any) -> str:
  return regex_escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _generic_value(depth: int) -> str:
  alts = [STRING, NUMBER, BOOLEAN, NULL]
  if depth > 0:
    alts += [_generic_object(depth - 1), _generic_array(depth - 1)]
  return "(?:" + "|".join(alts) + ")"


def _generic_object(depth: int) -> str:
  member = f"{STRING}:{WS}{_generic_value(depth)}"
  return rf"\{{(?:{member}(?:,{WS}{member})*)?\}}"


def _generic_array(depth: int) -> str:
  item = _generic_value(depth)
  return rf"\[(?:{item}(?:,{WS}{item})*)?\]"


def _same_length_range(lo: str, hi: str) -> list[str]:
  """Alternatives matching the digit strings of one length from lo to hi (leading zeros kept)."""
  if lo == hi:
    return [lo]
  if len(lo) == 1:
    return [f"[{lo}-{hi}]"]
  if lo[0] == hi[0]:
    return [lo[0] + "(?:" + "|".join(_same_length_range(lo[1:], hi[1:])) + ")"]
  n = len(lo) - 1
  if lo[1:] == "0" * n and hi[1:] == "9" * n:
    return [f"[{lo[0]}-{hi[0]}][0-9]{{{n}}}"]
  out = _same_length_range(lo, lo[0] + "9" * n)
  if int(hi[0]) - int(lo[0]) > 1:
    out.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{n}}}")
  return out + _same_length_range(hi[0] + "0" * n, hi)


def _natural_range(lo: int, hi: int) -> list[str]:
  """Alternatives matching the decimal naturals lo..hi (0 <= lo <= hi), no leading zeros."""
  out = []
  while lo <= hi:
    top = min(hi, 10 ** len(str(lo)) - 1)
    out += _same_length_range(str(lo), str(top))
    lo = top + 1
  return out


def integer_range_regex(lo: int | None, hi: int | None) -> str:
  """A regex for the integers in [lo, hi] (None: at most 16 digits that way)."""
  cap = 10**16 - 1
  lo = -cap if lo is None else lo
  hi = cap if hi is None else hi
  alts = []
  if lo < 0:
    alts += ["-" + a for a in _natural_range(max(1, -hi), -lo)]
  if hi >= 0:
    alts += _natural_range(max(0, lo), hi)
  return "(?:" + "|".join(alts) + ")"


class _TooDeep(Exception):
  """A recursive $ref nested past MAX_REF_DEPTH; an optional branch containing it is dropped."""


class _SchemaToRegex:
  def __init__(self, root: Any):
    self.root = root
    self.refs: list[str] = []

  def error(self, path: str, message: str) -> SchemaError:
    return SchemaError(path, message)

  def value(self, schema: Any, path: str) -> str:
    if schema is True or schema == {}:
      return _generic_value(GENERIC_DEPTH)
    if schema is False:
      raise self.error(path, "the schema `false` matches nothing")
    if not isinstance(schema, dict):
      raise self.error(path, f"got {schema!r}; expected a schema object or a boolean")
    keys = set(schema) - _ANNOTATIONS
    if "$ref" in keys:
      self.check_keys(schema, {"$ref"}, path)
      return self.ref(schema["$ref"], path)
    if "allOf" in keys:
      self.check_keys(schema, {"allOf"}, path)
      parts = schema["allOf"]
      if not isinstance(parts, list) or len(parts) != 1:
        raise self.error(path + ".allOf", "only a single-schema allOf is supported")
      return self.value(parts[0], path + ".allOf[0]")
    for union in ("anyOf", "oneOf"):
      if union in keys:
        self.check_keys(schema, {union}, path)
        return self.union(schema[union], path + "." + union, exclusive=union == "oneOf")
    if "enum" in keys or "const" in keys:
      return self.constants(schema, path)
    types = schema.get("type")
    if types is None:
      types = self.infer_type(schema)
    if types is None:
      self.check_keys(schema, set(), path)
      return _generic_value(GENERIC_DEPTH)
    if isinstance(types, str):
      types = [types]
    if not isinstance(types, list) or not types or any(t not in _TYPE_KEYWORDS for t in types):
      raise self.error(path + ".type", f"got {types!r}; expected one of {sorted(_TYPE_KEYWORDS)}")
    allowed = set().union(*(_TYPE_KEYWORDS[t] for t in types)) | {"type"}
    self.check_keys(schema, allowed, path)
    alts = [self.typed(t, schema, path) for t in dict.fromkeys(types)]
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

  def check_keys(self, schema: dict, allowed: set[str], path: str) -> None:
    extra = sorted(set(schema) - _ANNOTATIONS - allowed)
    if extra:
      raise self.error(
        path,
        f"unsupported keyword(s) {extra} here (supported: type, enum, const, anyOf, oneOf, "
        f"$ref, single allOf; per type: "
        + "; ".join(f"{t}: {', '.join(sorted(k)) or '-'}" for t, k in _TYPE_KEYWORDS.items())
        + ")",
      )

  @staticmethod
  def infer_type(schema: dict) -> str | None:
    for t in ("object", "array", "string"):
      if set(schema) & _TYPE_KEYWORDS[t]:
        return t
    if set(schema) & _TYPE_KEYWORDS["integer"]:
      return "number"  # bounds without a type: rejected as unsupported on numbers
    return None

  def ref(self, ref: Any, path: str) -> str:
    if not isinstance(ref, str) or not ref.startswith("#"):
      raise self.error(path + ".$ref", f"got {ref!r}; only local references ('#/...') work")
    if self.refs.count(ref) >= MAX_REF_DEPTH:
      raise _TooDeep(ref)
    target = self.root
    for part in [p for p in ref[1:].split("/") if p]:
      part = part.replace("~1", "/").replace("~0", "~")
      if isinstance(target, dict) and part in target:
        target = target[part]
      elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
        target = target[int(part)]
      else:
        raise self.error(path + ".$ref", f"{ref!r} points at nothing in the schema")
    self.refs.append(ref)
    try:
      return self.value(target, path + f"<{ref}>")
    finally:
      self.refs.pop()

  def union(self, branches: Any, path: str, *, exclusive: bool) -> str:
    if not isinstance(branches, list) or not branches:
      raise self.error(path, f"got {branches!r}; expected a non-empty list of schemas")
    if exclusive:
      kinds = [self.kinds(b) for b in branches]
      if any(k is None for k in kinds) or sum(map(len, kinds)) != len(set().union(*kinds)):
        raise self.error(
          path, "oneOf branches must differ in JSON type (or be distinct constants); use anyOf"
        )
    alts = []
    for i, b in enumerate(branches):
      try:
        alts.append(self.value(b, f"{path}[{i}]"))
      except _TooDeep:
        continue
    if not alts:
      raise _TooDeep(path)
    return "(?:" + "|".join(alts) + ")"

  def kinds(self, schema: Any) -> set | None:
    """What a oneOf branch can produce, to check branches are disjoint: JSON types, or constants
    as ("const", text); None when unknown."""
    if not isinstance(schema, dict):
      return None
    if "enum" in schema or "const" in schema:
      values = schema.get("enum", [schema.get("const")])
      return {("const", json.dumps(v, sort_keys=True)) for v in values}
    t = schema.get("type") or self.infer_type(schema)
    if t is None:
      return None
    t = {t} if isinstance(t, str) else set(t)
    return t | {"number"} if "integer" in t else t | ({"integer"} if "number" in t else set())

  def constants(self, schema: dict, path: str) -> str:
    self.check_keys(schema, {"enum", "const", "type"}, path)
    if "enum" in schema and "const" in schema:
      raise self.error(path, "set enum or const, not both")
    key = "enum" if "enum" in schema else "const"
    values = schema["enum"] if key == "enum" else [schema["const"]]
    if not isinstance(values, list):
      raise self.error(path + ".enum", f"got {values!r}; expected a list")
    if "type" in schema:
      types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
      numeric = "number" in types
      values = [
        v for v in values if _json_type(v) in types or numeric and _json_type(v) == "integer"
      ]
    if not values:
      raise self.error(path + "." + key, "no value satisfies the schema (unsatisfiable)")
    return "(?:" + "|".join(_json_literal(v) for v in values) + ")"

  def typed(self, t: str, schema: dict, path: str) -> str:
    if t == "string":
      return self.string(schema, path)
    if t == "integer":
      return self.integer(schema, path)
    if t == "number":
      return NUMBER
    if t == "boolean":
      return BOOLEAN
    if t == "null":
      return NULL
    if t == "array":
      return self.array(schema, path)
    return self.object(schema, path)

  def count(self, schema: dict, name: str, path: str) -> int | None:
    v = schema.get(name)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
      raise self.error(f"{path}.{name}", f"got {v!r}; expected a non-negative integer")
    return v

  def string(self, schema: dict, path: str) -> str:
    fmt = schema.get("format")
    if fmt is not None:
      if fmt not in _FORMATS:
        raise self.error(path + ".format", f"got {fmt!r}; supported: {sorted(_FORMATS)}")
      if "minLength" in schema or "maxLength" in schema:
        raise self.error(path, "format with minLength/maxLength is not supported")
      return _FORMATS[fmt]
    lo = self.count(schema, "minLength", path) or 0
    hi = self.count(schema, "maxLength", path)
    if hi is not None and hi < lo:
      raise self.error(path, f"minLength={lo} > maxLength={hi} (unsatisfiable)")
    return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'

  def integer(self, schema: dict, path: str) -> str:
    bounds = {}
    for name in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
      v = schema.get(name)
      if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
        raise self.error(f"{path}.{name}", f"got {v!r}; expected a number")
      bounds[name] = v
    if all(v is None for v in bounds.values()):
      return INTEGER
    los = [math.ceil(bounds["minimum"])] if bounds["minimum"] is not None else []
    if bounds["exclusiveMinimum"] is not None:
      los.append(math.floor(bounds["exclusiveMinimum"]) + 1)
    his = [math.floor(bounds["maximum"])] if bounds["maximum"] is not None else []
    if bounds["exclusiveMaximum"] is not None:
      his.append(math.ceil(bounds["exclusiveMaximum"]) - 1)
    lo, hi = max(los, default=None), min(his, default=None)
    if lo is not None and hi is not None and lo > hi:
      raise self.error(path, f"no integer lies in [{lo}, {hi}] (unsatisfiable)")
    return integer_range_regex(lo, hi)

  def array(self, schema: dict, path: str) -> str:
    lo = self.count(schema, "minItems", path) or 0
    hi = self.count(schema, "maxItems", path)
    if hi is not None and hi < lo:
      raise self.error(path, f"minItems={lo} > maxItems={hi} (unsatisfiable)")
    if "prefixItems" in schema:
      items = schema["prefixItems"]
      if not isinstance(items, list) or schema.get("items", False) is not False:
        raise self.error(path + ".prefixItems", "expected a list, with no `items` beside it")
      if not lo <= len(items) <= (len(items) if hi is None else hi):
        raise self.error(path, f"{len(items)} prefixItems outside [minItems, maxItems]")
      parts = [self.value(s, f"{path}.prefixItems[{i}]") for i, s in enumerate(items)]
      return r"\[" + f",{WS}".join(parts) + r"\]"
    if hi == 0:
      return r"\[\]"
    try:
      if "items" in schema:
        item = self.value(schema["items"], path + ".items")
      else:
        item = _generic_value(GENERIC_DEPTH - 1)
    except _TooDeep:
      if lo > 0:
        raise
      return r"\[\]"
    more = f"{{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
    body = f"{item}(?:,{WS}{item}){more}"
    return rf"\[{body}\]" if lo > 0 else rf"\[(?:{body})?\]"

  def object(self, schema: dict, path: str) -> str:
    props = schema.get("properties")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
      raise self.error(path + ".required", f"got {required!r}; expected a list of names")
    if props is None:
      if required:
        raise self.error(path + ".required", "required properties need their `properties`")
      extra = schema.get("additionalProperties", True)
      if extra is False:
        return r"\{\}"
      if extra is True or extra == {}:
        return _generic_object(GENERIC_DEPTH - 1)
      value = self.value(extra, path + ".additionalProperties")
      member = f"{STRING}:{WS}{value}"
      return rf"\{{(?:{member}(?:,{WS}{member})*)?\}}"
    if not isinstance(props, dict):
      raise self.error(path + ".properties", f"got {props!r}; expected an object")
    missing = [r for r in required if r not in props]
    if missing:
      raise self.error(path + ".required", f"{missing} are required but not in properties")
    members = []  # (regex, required) in declaration order
    for name, sub in props.items():
      try:
        value = self.value(sub, f"{path}.properties.{name}")
      except _TooDeep:
        if name in required:
          raise
        continue
      members.append((f"{_json_literal(name)}:{WS}{value}", name in required))

    # tail(i): members i.. each preceded by a comma; head(i): the same with no comma before the
    # first one present. Optional members may be left out; the order is the declared one.
    def tail(i: int) -> str:
      if i == len(members):
        return ""
      m, req = members[i]
      return f",{WS}{m}{tail(i + 1)}" if req else f"(?:,{WS}{m})?{tail(i + 1)}"

    def head(i: int) -> str:
      if i == len(members):
        return ""
      m, req = members[i]
      if req:
        return m + tail(i + 1)
      rest = head(i + 1)
      return f"(?:{m}{tail(i + 1)}" + (f"|{rest})" if rest else ")?")

    return rf"\{{{head(0)}\}}"


def _json_type(value: Any) -> str:
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, int):
    return "integer"
  if isinstance(value, float):
    return "number"
  if isinstance(value, str):
    return "string"
  return "array" if isinstance(value, list) else "object"


def json_schema_regex(schema: Any) -> str:
  """A regex whose every match is a JSON text that validates against `schema`.

  Raises:
    SchemaError: an unsupported keyword, an unsatisfiable schema, a bad $ref.
  """
  try:
    return _SchemaToRegex(schema).value(schema, "")
  except _TooDeep as e:
    raise SchemaError(
      "", f"$ref {e} recurses more than {MAX_REF_DEPTH} levels on a required path"
    ) from None


def generic_object_regex() -> str:
  """Any JSON object (OpenAI's `json_object`), containers nested two levels deep."""
  return _generic_object(GENERIC_DEPTH)


__all__ = [
  "SchemaError",
  "choice_regex",
  "generic_object_regex",
  "integer_range_regex",
  "json_schema_regex",
  "regex_escape",
]
