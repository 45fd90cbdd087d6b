"""Guided decoding: constraints -> token automata over real tokenizers, checked by brute force;
schemas -> regexes whose every match validates; rollback; the mask inside `sample_rows`."""

import itertools
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from atlas_jax.data.tokenizer import ByteTokenizer, train_bpe
from atlas_jax.decoding.guided import (
  GrammarCompiler,
  GuidedDecodingError,
  ReasoningGate,
  spec_from_request,
  unpack_bits,
)
from atlas_jax.decoding.json_schema import integer_range_regex, json_schema_regex
from atlas_jax.decoding.sampling import SamplingArrays, SamplingParams, sample_rows, unpack_allowed

CORPUS = [
  '{"name": "ab", "age": 7, "ok": true, "tags": ["a", "b"]}\n' * 20,
  "yes no nope maybe n/a ja é e0 é12 e99 " * 20,
  "def f(x):\n  return x + 1\n" * 20,
]


@pytest.fixture(scope="module")
def bpe():
  return train_bpe(CORPUS, 320)


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def compiler(request, bpe):
  if request.param == "bytes":  # a model vocabulary wider than the tokenizer's (padded)
    return GrammarCompiler(ByteTokenizer(), vocab_size=300, timeout_s=5)
  return GrammarCompiler(bpe, timeout_s=5)


@pytest.fixture(scope="module")
def tokenizers(bpe):
  return {"bytes": ByteTokenizer(), "bpe": bpe}


def test_token_bytes_spell_the_text(bpe):
  pieces = bpe.token_bytes()
  text = 'def g(y):\n  return {"é": "☃", "n": [1, 2]}'
  assert b"".join(pieces[i] for i in bpe.encode(text)) == text.encode()
  assert [pieces[i] for i in (bpe.pad_id, bpe.bos_id, bpe.eos_id)] == [None, None, None]
  assert ByteTokenizer().token_bytes()[:256] == [bytes([i]) for i in range(256)]


def _pieces(compiler, tokenizers, bpe):
  tok = tokenizers["bytes"] if compiler.vocab_size == 300 else bpe
  pieces = tok.token_bytes()
  return pieces + [None] * (compiler.vocab_size - len(pieces))


def _check_against_language(matcher, language: set[bytes], pieces, eos_id: int) -> int:
  """Depth-first over every prefix of the language reachable by tokens: the mask must be exactly
  {t : prefix + bytes(t) is a prefix of some string} plus eos where prefix is whole. Each child
  is left by rollback(1), which must restore the parent's mask. Returns the prefixes checked."""
  prefixes = {s[:i] for s in language for i in range(len(s) + 1)}
  seen = 0

  def visit(prefix: bytes):
    nonlocal seen
    seen += 1
    want = np.array(
      [p is not None and len(p) > 0 and prefix + p in prefixes for p in pieces], dtype=bool
    )
    want[eos_id] = prefix in language
    got = matcher.allowed_mask()
    np.testing.assert_array_equal(got, want, err_msg=f"prefix {prefix!r}")
    assert matcher.is_final == (prefix in language)
    assert matcher.is_complete == (prefix in language and want.sum() == 1)
    for t in np.flatnonzero(want):
      if t == eos_id:
        continue
      matcher.advance(int(t))
      visit(prefix + pieces[t])
      matcher.rollback(1)
      np.testing.assert_array_equal(matcher.allowed_mask(), got)

  visit(b"")
  return seen


def test_choice_mask_equals_brute_force(compiler, tokenizers, bpe):
  choices = ["yes", "no", "nope", "maybe", "n/a", "ja", "né"]
  grammar = compiler.compile(spec_from_request(guided_choice=choices))
  pieces = _pieces(compiler, tokenizers, bpe)
  n = _check_against_language(
    grammar.matcher(), {c.encode() for c in choices}, pieces, compiler.eos_id
  )
  assert n >= len({c[:i] for c in choices for i in range(len(c) + 1)})


def test_regex_mask_equals_brute_force(compiler, tokenizers, bpe):
  regex = r"(é|e)[0-9]{1,2}(/x)?"
  language = {
    (h + "".join(d) + x).encode()
    for h in ("é", "e")
    for k in (1, 2)
    for d in itertools.product("0123456789", repeat=k)
    for x in ("", "/x")
  }
  assert all(re.fullmatch(regex, s.decode()) for s in language)
  grammar = compiler.compile(spec_from_request(guided_regex=regex))
  _check_against_language(
    grammar.matcher(), language, _pieces(compiler, tokenizers, bpe), compiler.eos_id
  )


def test_rollback_restores_the_exact_mask(compiler):
  grammar = compiler.compile(spec_from_request(guided_regex=r"[a-c]{2,6}(-[0-9]+)?"))
  m = grammar.matcher()
  rng = np.random.default_rng(0)
  masks = [m.allowed_bits().copy()]
  while not m.is_complete and m.n_tokens < 12:
    allowed = np.flatnonzero(m.allowed_mask())
    allowed = allowed[allowed != compiler.eos_id]
    if not len(allowed):
      break
    m.advance(int(rng.choice(allowed)))
    masks.append(m.allowed_bits().copy())
  for n in (3, 1, 2):
    m.rollback(n)
    del masks[len(masks) - n :]
    np.testing.assert_array_equal(m.allowed_bits(), masks[-1])
  with pytest.raises(ValueError, match="rollback"):
    m.rollback(m.n_tokens + 1)
  bad = int(np.flatnonzero(~m.allowed_mask())[0])
  with pytest.raises(ValueError, match="not allowed"):
    m.advance(bad)
  m.reset()
  np.testing.assert_array_equal(m.allowed_bits(), masks[0])


def test_a_reasoning_gate_passes_every_token_until_the_end_token():
  """Bytes, with "#" standing for </think> and "@" for <think>: the grammar starts on the step
  after "#", rolls back across it, and starts at once when the prompt closed the thinking."""
  compiler = GrammarCompiler(ByteTokenizer())
  grammar = compiler.compile(spec_from_request(guided_choice=["yes", "no"]))
  gate = ReasoningGate(grammar, end_id=ord("#"), start_id=ord("@"))
  m = gate.matcher(list(b"user: @"))
  every = np.full(grammar.n_words, -1, np.int32)
  for t in b"x{ #":  # "x", "{", " " are not allowed by the grammar; "#" ends the thinking
    np.testing.assert_array_equal(m.allowed_bits(), every)
    assert m.waiting and not m.is_complete and m.accepts(t)
    m.advance(t)
  assert not m.waiting
  start = grammar.matcher()
  np.testing.assert_array_equal(m.allowed_bits(), start.allowed_bits())
  assert not m.accepts(ord("x")) and m.accepts(ord("y"))
  for t in b"yes":
    m.advance(t)
  assert m.is_complete
  m.rollback(4)  # back before "#": waiting again
  assert m.waiting and m.accepts(ord("x"))
  with pytest.raises(ValueError, match="not allowed"):
    m.advance(compiler.vocab_size)
  for prompt, waits in [(b"@..#", False), (b"#..@", True), (b"", True), (b"@#\n\n", False)]:
    assert gate.matcher(list(prompt)).waiting == waits, prompt
  assert not grammar.matcher(list(b"@")).waiting  # a plain grammar ignores the prompt
  with pytest.raises(ValueError, match="end_id=258"):
    ReasoningGate(grammar, end_id=compiler.eos_id)


SCHEMAS = [
  {
    "type": "object",
    "properties": {
      "name": {"type": "string", "minLength": 1, "maxLength": 4},
      "age": {"type": "integer", "minimum": -3, "maximum": 120},
      "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 2},
      "ok": {"type": ["boolean", "null"]},
    },
    "required": ["name", "age"],
  },
  {
    "$defs": {"point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "integer"}]}},
    "type": "object",
    "properties": {
      "kind": {"const": "pt"},
      "at": {"$ref": "#/$defs/point"},
      "when": {"type": "string", "format": "date"},
      "score": {"anyOf": [{"type": "integer", "exclusiveMinimum": 10}, {"type": "null"}]},
      "id": {"oneOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]},
    },
    "required": ["kind", "at", "id"],
  },
  {  # recursive: children are optional, so the recursion is cut where it runs too deep
    "type": "object",
    "properties": {
      "v": {"type": "boolean"},
      "child": {"$ref": "#"},
    },
    "required": ["v"],
  },
]


def _random_walk(matcher, eos_id, rng, max_tokens=400):
  """Random allowed tokens until the output is complete, or whole and a coin says stop."""
  out = []
  while not matcher.is_complete and len(out) < max_tokens:
    if matcher.is_final and rng.random() < 0.3:
      break
    allowed = np.flatnonzero(matcher.allowed_mask())
    t = int(rng.choice(allowed[allowed != eos_id]))
    matcher.advance(t)
    out.append(t)
  return out


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_walks_through_a_schema_validate(compiler, tokenizers, bpe, index):
  schema = SCHEMAS[index]
  grammar = compiler.compile(spec_from_request(guided_json=schema))
  pieces = _pieces(compiler, tokenizers, bpe)
  rng = np.random.default_rng(index)
  for _ in range(25):
    m = grammar.matcher()
    ids = _random_walk(m, compiler.eos_id, rng)
    assert m.is_final, "the walk must end on a whole output"
    value = json.loads(b"".join(pieces[i] for i in ids))
    jsonschema.validate(value, schema)


def test_json_object_walks_parse():
  compiler = GrammarCompiler(ByteTokenizer())
  grammar = compiler.compile(spec_from_request(response_format={"type": "json_object"}))
  rng = np.random.default_rng(0)
  for _ in range(10):
    m = grammar.matcher()
    ids = _random_walk(m, compiler.eos_id, rng, max_tokens=4000)
    if m.is_final:
      assert isinstance(json.loads(bytes(ids)), dict)


def test_schema_regex_bounds_whitespace():
  rx = json_schema_regex(
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
  )
  ok = ['{"a":true}', '{"a": false}']
  bad = ['{"a":  true}', '{ "a":true}', '{"a":true }', '{"a":\ntrue}']
  assert all(re.fullmatch(rx, s) for s in ok)
  assert not any(re.fullmatch(rx, s) for s in bad)


@pytest.mark.parametrize(
  "lo,hi", [(0, 0), (5, 123), (-17, 42), (-1000, -3), (7, None), (None, -5), (99, 101)]
)
def test_integer_range_regex_is_exact(lo, hi):
  pattern = re.compile(integer_range_regex(lo, hi))
  for n in range(-1500, 1500):
    want = (lo is None or n >= lo) and (hi is None or n <= hi)
    assert (pattern.fullmatch(str(n)) is not None) == want, n
  assert not pattern.fullmatch("007") and not pattern.fullmatch("-0")


@pytest.mark.parametrize(
  "request_fields,field,message",
  [
    (dict(guided_regex="(a"), "guided_regex", "missing ), unterminated subpattern"),
    (dict(guided_regex="a)|(b"), "guided_regex", "unbalanced ')'"),
    (dict(guided_regex="(?=a)b"), "guided_regex", "cannot compile"),
    (dict(guided_choice=[]), "guided_choice", "non-empty list"),
    (dict(guided_choice=["a", 1]), "guided_choice", "non-empty list"),
    (dict(guided_json={"enum": []}), "guided_json.enum", "unsatisfiable"),
    (dict(guided_json={"type": "integer", "minimum": 5, "maximum": 2}), "guided_json", "[5, 2]"),
    (dict(guided_json={"type": "string", "minLength": 3, "maxLength": 1}), "guided_json", "unsat"),
    (dict(guided_json={"type": "string", "enum": [1, 2]}), "guided_json.enum", "unsatisfiable"),
    (dict(guided_json={"type": "number", "multipleOf": 2}), "guided_json", "multipleOf"),
    (
      dict(guided_json={"type": "object", "properties": {"a": {"not": {}}}}),
      "guided_json.properties.a",
      "'not'",
    ),
    (dict(guided_json={"allOf": [{}, {}]}), "guided_json.allOf", "single-schema"),
    (
      dict(guided_json={"oneOf": [{"type": "integer"}, {"type": "number"}]}),
      "guided_json.oneOf",
      "anyOf",
    ),
    (dict(guided_json={"$ref": "#/nowhere"}), "guided_json.$ref", "points at nothing"),
    (dict(guided_json={"type": "tuple"}), "guided_json.type", "expected one of"),
    (dict(guided_json="{not json"), "guided_json", "not valid JSON"),
    (dict(guided_json={"type": "object", "required": ["a"]}), "guided_json.required", "properties"),
    (
      dict(guided_json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
      "guided_json",
      "recurses",
    ),
    (dict(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "schema"),
    (
      dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
      "response_format.json_schema.schema",
      "expected a JSON schema",
    ),
    (dict(guided_regex="a", guided_choice=["a"]), "guided_choice", "only one constraint"),
  ],
)
def test_bad_constraints_name_their_field(request_fields, field, message):
  compiler = GrammarCompiler(ByteTokenizer(), timeout_s=5)
  with pytest.raises(GuidedDecodingError) as info:
    compiler.compile(spec_from_request(**request_fields))
  assert info.value.field == field
  assert message in str(info.value)


def test_a_state_explosion_is_cut_by_the_time_limit():
  compiler = GrammarCompiler(ByteTokenizer(), timeout_s=0.5)
  with pytest.raises(GuidedDecodingError, match="did not compile within 0.5s"):
    compiler.compile(spec_from_request(guided_regex="(a|b)*a(a|b){24}"))


def test_compiled_grammars_are_cached():
  compiler = GrammarCompiler(ByteTokenizer())
  spec = spec_from_request(guided_choice=["x", "y"])
  assert compiler.compile(spec) is compiler.compile(spec)


def test_sample_rows_draws_only_allowed_tokens_and_keeps_model_logprobs():
  B, V = 4, 70
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
  allowed = rng.random((B, V)) < 0.2
  allowed[3] = True  # an unguided row
  allowed[0] = False
  allowed[0, [5, 66]] = True
  bits = np.zeros((B, -(-V // 32)), np.uint32)
  for b, v in zip(*np.nonzero(allowed)):
    bits[b, v // 32] |= np.uint32(1 << (v % 32))
  bits = bits.view(np.int32)
  np.testing.assert_array_equal(np.asarray(unpack_allowed(jnp.asarray(bits), V)), allowed)
  np.testing.assert_array_equal(unpack_bits(bits[0], V), allowed[0])
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  for temperature, top_k in ((0.0, 0), (1.0, 0), (2.0, 3)):
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * B
    arrays = SamplingArrays.from_params(params, allowed_bits=bits)
    for seed in range(8):
      keys = jax.random.split(jax.random.key(seed), B)
      tok, tok_lp, _, top_lp = map(np.asarray, sample_rows(logits, keys, arrays))
      assert allowed[np.arange(B), tok].all()
      np.testing.assert_allclose(tok_lp, logp[np.arange(B), tok], rtol=1e-5)
      np.testing.assert_allclose(top_lp, -np.sort(-logp)[:, : top_lp.shape[1]], rtol=1e-5)
      if temperature == 0:
        want = np.where(allowed, np.asarray(logits), -np.inf).argmax(-1)
        np.testing.assert_array_equal(tok, want)
