"""Guided (constrained) decoding: the output must match a JSON schema, a regex or a list of choices.

A request's constraint (OpenAI's `response_format`, vLLM's `guided_json` / `guided_regex` /
`guided_choice`) becomes one regular expression, compiled to a token-level automaton over the
model's own tokenizer: for every state, the tokens whose bytes keep the text a prefix of some
string of the language (and eos where the text is a whole one). The regex -> token automaton step
is `outlines-core` (a byte DFA walked by every vocabulary entry, in Rust, no other dependency);
the JSON schema -> regex step is ours (`atlas_jax.decoding.json_schema`), because the library's
converter silently drops keywords, so a completed output could fail its schema. (xgrammar, the
other maintained choice, requires torch, triton and transformers at install time.)

Compilation runs in a child process with a time limit (a regex such as `(a|b)*a(a|b){30}` has a
DFA of 2^30 states): it is killed past `timeout_s` and the request gets an error, never a hang.
Compiled grammars are cached by regex. Per request, a `GuidedMatcher` walks the automaton: the
allowed tokens as a packed bitmask i32[W] (bit v % 32 of word v // 32, W = ceil(V / 32)), advance
by a token, roll back by n tokens (rejected speculative drafts), and whether only eos remains.

A thinking model's constraint applies to its answer, after the thinking, as vLLM applies it: a
`ReasoningGate` wraps a Grammar with the end-of-reasoning token (`</think>`), and its matchers
start in a waiting state that allows every token and moves into the grammar's initial state on
the step that draws that token. A prompt that already closed its thinking (a template that
writes an empty `<think></think>` when thinking is off) starts the grammar at once.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pickle
import re
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from atlas_jax.decoding.json_schema import (
  SchemaError,
  choice_regex,
  generic_object_regex,
  json_schema_regex,
)


class GuidedDecodingError(ValueError):
  """A constraint that cannot be compiled: `field` names the request field at fault."""

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field = field


@dataclasses.dataclass(frozen=True)
class GuidedSpec:
  """What a request asks for: `kind` is "json_schema", "json_object", "regex" or "choice";
  `value` the schema (canonical JSON text), the regex, or the choices (a tuple)."""

  kind: str
  value: Any
  field: str  # the request field it came from, for errors


def spec_from_request(
  *,
  response_format: Any = None,
  guided_json: Any = None,
  guided_regex: Any = None,
  guided_choice: Any = None,
  structured_outputs: Any = None,
) -> GuidedSpec | None:
  """The constraint of a request in the OpenAI / vLLM shapes, or None.

  `structured_outputs` is vLLM's newer field: {"json": schema}, {"regex": ...}, {"choice": [...]}
  or {"json_object": true}, each read as the guided_* field of the same name.

  Raises:
    GuidedDecodingError: a malformed field, or more than one constraint.
  """
  given = []
  if structured_outputs is not None:
    given += _structured_outputs(structured_outputs)
  if response_format is not None:
    field = "response_format"
    if not isinstance(response_format, dict) or response_format.get("type") not in (
      "text",
      "json_object",
      "json_schema",
    ):
      raise GuidedDecodingError(
        field + ".type",
        f"got {response_format!r}; expected {{'type': 'text' | 'json_object' | 'json_schema'}}",
      )
    kind = response_format["type"]
    extra = set(response_format) - {"type", "json_schema"}
    if extra:
      raise GuidedDecodingError(field, f"unknown key(s) {sorted(extra)}")
    if kind == "json_object":
      given.append(GuidedSpec("json_object", None, field))
    elif kind == "json_schema":
      inner = response_format.get("json_schema")
      if not isinstance(inner, dict) or "schema" not in inner:
        raise GuidedDecodingError(
          field + ".json_schema",
          f"got {inner!r}; expected {{'name': ..., 'schema': {{...}}, 'strict': ...}}",
        )
      if not isinstance(inner.get("name", ""), str):
        raise GuidedDecodingError(field + ".json_schema.name", "must be a string")
      given.append(_schema_spec(inner["schema"], field + ".json_schema.schema"))
  if guided_json is not None:
    schema = guided_json
    if isinstance(schema, str):
      try:
        schema = json.loads(schema)
      except json.JSONDecodeError as e:
        raise GuidedDecodingError("guided_json", f"not valid JSON: {e}") from None
    given.append(_schema_spec(schema, "guided_json"))
  if guided_regex is not None:
    if not isinstance(guided_regex, str):
      raise GuidedDecodingError("guided_regex", f"got {guided_regex!r}; expected a string")
    given.append(GuidedSpec("regex", guided_regex, "guided_regex"))
  if guided_choice is not None:
    if (
      not isinstance(guided_choice, list | tuple)
      or not guided_choice
      or not all(isinstance(c, str) for c in guided_choice)
    ):
      raise GuidedDecodingError(
        "guided_choice", f"got {guided_choice!r}; expected a non-empty list of strings"
      )
    given.append(GuidedSpec("choice", tuple(guided_choice), "guided_choice"))
  if len(given) > 1:
    raise GuidedDecodingError(
      given[1].field, f"only one constraint per request; {given[0].field} is also set"
    )
  return given[0] if given else None


_STRUCTURED_KEYS = ("json", "regex", "choice", "json_object")


def _structured_outputs(value: Any) -> list[GuidedSpec]:
  field = "structured_outputs"
  if not isinstance(value, dict):
    raise GuidedDecodingError(field, f"got {value!r}; expected an object")
  unknown = sorted(k for k, v in value.items() if k not in _STRUCTURED_KEYS and v is not None)
  if unknown:
    raise GuidedDecodingError(
      f"{field}.{unknown[0]}", f"is not supported; the keys served are {list(_STRUCTURED_KEYS)}"
    )
  given = []
  for key in _STRUCTURED_KEYS:
    v = value.get(key)
    if v is None or v is False:
      continue
    where = f"{field}.{key}"
    if key == "json_object":
      given.append(GuidedSpec("json_object", None, where))
      continue
    try:
      spec = spec_from_request(**{"guided_" + key: v})
    except GuidedDecodingError as e:
      raise GuidedDecodingError(where, str(e).split(": ", 1)[-1]) from None
    given.append(dataclasses.replace(spec, field=where))
  return given


def spec_regex(spec: GuidedSpec) -> str:
  """The regular expression of a constraint.

  Raises:
    GuidedDecodingError: the schema cannot be turned into one (names the field and the path).
  """
  if spec.kind == "regex":
    return spec.value
  if spec.kind == "choice":
    return choice_regex(spec.value)
  if spec.kind == "json_object":
    return generic_object_regex()
  try:
    return json_schema_regex(json.loads(spec.value))
  except SchemaError as e:
    raise GuidedDecodingError(spec.field + e.path, e.message) from None


def _schema_spec(schema: Any, field: str) -> GuidedSpec:
  if not isinstance(schema, dict | bool):
    raise GuidedDecodingError(field, f"got {schema!r}; expected a JSON schema object")
  return GuidedSpec("json_schema", json.dumps(schema, sort_keys=False), field)


# -- the token automaton -------------------------------------------------------------------------

# The regex is compiled as `(?:R)` + END, END a character no real token can spell (its lead
# byte 0xF4 is left out of the vocabulary), spelt by one extra token, END_ID; a state is final
# where END_ID leads to acceptance. Why: outlines-core 0.2.14 drops a token whose bytes pass
# through a complete match and go on (after "no" in (no|nope), the token "p"); with END, no
# prefix of an output is a complete match. The cost: characters U+100000..U+10FFFF (private
# use) cannot be generated.
END = "\\x{10FFFF}"
END_BYTES = chr(0x10FFFF).encode()
END_ID = 2**31 - 1

_COMPILE = """
import pickle, sys
import outlines_core
regex, eos_id, token_map = pickle.load(sys.stdin.buffer)
try:
  index = outlines_core.Index(regex, outlines_core.Vocabulary(eos_id, token_map))
except Exception as e:
  sys.stderr.write(str(e))
  sys.exit(3)
sys.stdout.buffer.write(pickle.dumps(index))
"""


def _closes_early(regex: str) -> bool:
  """Whether `regex` has a `)` with no `(` before it (outside escapes and classes), which would
  close the group it is wrapped in and change its meaning."""
  depth, in_class, i = 0, 0, 0
  while i < len(regex):
    ch = regex[i]
    if ch == "\\":
      i += 2
      continue
    if in_class:
      if ch == "[":
        in_class += 1
      elif ch == "]":
        in_class -= 1
    elif ch == "[":
      in_class = 1
      if regex[i + 1 : i + 2] == "^":
        i += 1
      if regex[i + 1 : i + 2] == "]":  # a leading ']' is a literal
        i += 1
    elif ch == "(":
      depth += 1
    elif ch == ")":
      depth -= 1
      if depth < 0:
        return True
    i += 1
  return False


class Grammar:
  """A compiled constraint over one vocabulary: the token automaton and a cache of the packed
  allowed-token masks of the states visited so far. Shared by every request that uses it."""

  def __init__(self, index, *, eos_id: int, vocab_size: int, description: str):
    self._index = index
    self.eos_id = eos_id
    self.vocab_size = vocab_size  # V, the model's
    self.n_words = -(-vocab_size // 32)  # W
    self.description = description
    self.initial_state = index.get_initial_state()
    self._masks: dict[int, tuple[np.ndarray, bool, bool]] = {}
    self.all_bits = np.full(self.n_words, -1, np.int32)  # i32[W] no constraint (read-only)
    self.all_bits.flags.writeable = False

  def mask(self, state: int) -> tuple[np.ndarray, bool, bool]:
    """(i32[W] packed allowed tokens, whether eos is allowed, whether it is the only one)."""
    got = self._masks.get(state)
    if got is None:
      ids = np.asarray(self._index.get_allowed_tokens(state), np.int64)
      # END may also be allowed as a character of R (in `.`, say): the text is whole only if the
      # automaton accepts right after it.
      final = bool(np.any(ids == END_ID)) and self._index.is_final_state(
        self._index.get_next_state(state, END_ID)
      )
      ids = ids[(ids < self.vocab_size) & (ids != self.eos_id)]
      only_eos = final and not len(ids)
      if final or not len(ids):
        # not len(ids) and not final: R goes on only through U+100000..U+10FFFF, which no token
        # here spells; ending the output beats a row with nothing to draw.
        ids = np.append(ids, self.eos_id)
      words = np.zeros(self.n_words, np.uint32)
      np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
      bits_W = words.view(np.int32)
      bits_W.flags.writeable = False
      got = (bits_W, final, only_eos)
      self._masks[state] = got
    return got

  def next_state(self, state: int, token: int) -> int | None:
    if token == self.eos_id:
      return state if self.is_final(state) else None
    if not 0 <= token < self.vocab_size:
      return None
    return self._index.get_next_state(state, token)

  def is_final(self, state: int) -> bool:
    return self.mask(state)[1]

  def matcher(self, prompt=()) -> GuidedMatcher:
    """A new request's matcher (`prompt`, its ids, matters to a ReasoningGate only)."""
    return GuidedMatcher(self)


# A matcher's state while it waits for the end of the reasoning (outlines-core's are ints >= 0).
WAITING = -1


class ReasoningGate:
  """A Grammar that applies after the reasoning: its matchers pass every token until
  `end_id` (`</think>`) is drawn, then follow the grammar from its initial state.

  Args:
    grammar: the answer's constraint.
    end_id: the end-of-reasoning token.
    start_id: the start-of-reasoning token (`<think>`), or None when it is not one token; read
      in the prompt only: the thinking has ended there when `end_id` comes after the last
      `start_id` (vLLM's `is_reasoning_end`).
  """

  def __init__(self, grammar: Grammar, *, end_id: int, start_id: int | None = None):
    if not 0 <= end_id < grammar.vocab_size or end_id == grammar.eos_id:
      raise ValueError(
        f"end_id={end_id} is not allowed: the end-of-reasoning token must be an id in "
        f"[0, {grammar.vocab_size}) other than eos ({grammar.eos_id})"
      )
    self.grammar, self.end_id, self.start_id = grammar, end_id, start_id
    self.vocab_size, self.eos_id = grammar.vocab_size, grammar.eos_id
    self.description = f"{grammar.description}, after token {end_id}"

  def reasoning_ended(self, prompt) -> bool:
    for token in reversed(prompt):
      if token == self.start_id:
        return False
      if token == self.end_id:
        return True
    return False

  def matcher(self, prompt=()) -> GuidedMatcher:
    ended = self.reasoning_ended(prompt)
    return GuidedMatcher(self.grammar, wait_for=None if ended else self.end_id)


class GuidedMatcher:
  """One request's walk through a Grammar: the states after each accepted token, so it rolls
  back by any number of tokens exactly. With `wait_for` (a token id), it starts in the WAITING
  state, where every token is allowed, and enters the grammar after that token."""

  def __init__(self, grammar: Grammar, wait_for: int | None = None):
    self.grammar = grammar
    self.wait_for = wait_for
    self._states = [grammar.initial_state if wait_for is None else WAITING]

  def _next(self, token: int) -> int | None:
    state = self._states[-1]
    if state != WAITING:
      return self.grammar.next_state(state, token)
    if not 0 <= token < self.grammar.vocab_size:
      return None
    return self.grammar.initial_state if token == self.wait_for else WAITING

  @property
  def waiting(self) -> bool:
    """Whether the grammar has not started yet (the reasoning goes on)."""
    return self._states[-1] == WAITING

  @property
  def n_tokens(self) -> int:
    """Tokens accepted so far."""
    return len(self._states) - 1

  def allowed_bits(self) -> np.ndarray:
    """i32[W] the allowed next tokens, packed: bit v % 32 of word v // 32 (read-only)."""
    if self.waiting:
      return self.grammar.all_bits
    return self.grammar.mask(self._states[-1])[0]

  def allowed_mask(self) -> np.ndarray:
    """bool[V] the allowed next tokens."""
    return unpack_bits(self.allowed_bits(), self.grammar.vocab_size)

  def accepts(self, token: int) -> bool:
    return self._next(int(token)) is not None

  def advance(self, token: int) -> None:
    """Moves past an accepted token (eos is accepted where the text is complete)."""
    state = self._next(int(token))
    if state is None:
      raise ValueError(
        f"token {int(token)} is not allowed after {self.n_tokens} tokens by the grammar "
        f"({self.grammar.description})"
      )
    self._states.append(state)

  def rollback(self, n: int) -> None:
    """Forgets the last `n` accepted tokens (rejected draft tokens)."""
    if not 0 <= n <= self.n_tokens:
      raise ValueError(f"rollback({n}): only {self.n_tokens} tokens were accepted")
    if n:
      del self._states[-n:]

  def reset(self) -> None:
    del self._states[1:]

  @property
  def is_final(self) -> bool:
    """The text so far is a whole match (eos is allowed); while waiting, eos is allowed as any
    token is (the output then has no answer)."""
    return self.waiting or self.grammar.is_final(self._states[-1])

  @property
  def is_complete(self) -> bool:
    """Nothing but eos may follow: the output is finished."""
    return not self.waiting and self.grammar.mask(self._states[-1])[2]


def unpack_bits(bits_W: np.ndarray, vocab_size: int) -> np.ndarray:
  """bool[V] from a packed i32[W] mask (bit v % 32 of word v // 32)."""
  v = np.arange(vocab_size)
  return ((bits_W.view(np.uint32)[v >> 5] >> (v & 31).astype(np.uint32)) & 1).astype(bool)


class GrammarCompiler:
  """Compiles constraints to Grammars over one tokenizer, with a time limit and a cache.

  Args:
    tokenizer: has `token_bytes()` (ByteTokenizer, HFTokenizer) and `eos_id`.
    vocab_size: the model's V (>= the tokenizer's; ids past the tokenizer's are never allowed).
    timeout_s: a compilation still running after this is killed and reported as an error.
    cache_size: compiled grammars kept, by regex.
  """

  def __init__(
    self, tokenizer, *, vocab_size: int | None = None, timeout_s: float = 10.0, cache_size=64
  ):
    pieces = tokenizer.token_bytes()
    self.vocab_size = vocab_size or len(pieces)
    if len(pieces) > self.vocab_size:
      raise ValueError(
        f"vocab_size={self.vocab_size} is smaller than the tokenizer's {len(pieces)} tokens"
      )
    if tokenizer.eos_id is None or tokenizer.eos_id < 0:
      raise ValueError("guided decoding needs a tokenizer with an eos token")
    self.eos_id = int(tokenizer.eos_id)
    token_map: dict[bytes, list[int]] = collections.defaultdict(list)
    for i, piece in enumerate(pieces):
      if piece and i != self.eos_id and END_BYTES[0] not in piece:
        token_map[piece].append(i)
    token_map[END_BYTES] = [END_ID]
    self._payload_map = dict(token_map)
    self.timeout_s = timeout_s
    self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
    self._cache_size = cache_size
    self._lock = threading.Lock()

  def compile(self, spec: GuidedSpec) -> Grammar:
    """Raises GuidedDecodingError naming `spec.field` when it cannot be compiled."""
    regex = spec_regex(spec)
    return self.compile_regex(regex, field=spec.field, description=f"{spec.field} ({spec.kind})")

  def compile_regex(self, regex: str, *, field: str = "guided_regex", description: str = ""):
    with self._lock:
      got = self._cache.get(regex)
      if got is not None:
        self._cache.move_to_end(regex)
        return got
    if _closes_early(regex):
      raise GuidedDecodingError(field, f"unbalanced ')' in the regex {regex[:200]!r}")
    payload = pickle.dumps((f"(?:{regex}){END}", self.eos_id, self._payload_map))
    try:
      proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], input=payload, capture_output=True, timeout=self.timeout_s
      )
    except subprocess.TimeoutExpired:
      raise GuidedDecodingError(
        field,
        f"the constraint did not compile within {self.timeout_s:g}s (its automaton is too "
        "large); simplify it",
      ) from None
    if proc.returncode != 0:
      try:  # Python's parser names the syntax error; the library's message does not
        re.compile(regex)
        detail = " ".join(proc.stderr.decode(errors="replace").split())[:400]
      except re.error as e:
        detail = str(e)
      raise GuidedDecodingError(field, f"cannot compile the regex {regex[:200]!r}: {detail}")
    index = pickle.loads(proc.stdout)
    grammar = Grammar(
      index, eos_id=self.eos_id, vocab_size=self.vocab_size, description=description or field
    )
    if not np.any(grammar.mask(grammar.initial_state)[0]):
      raise GuidedDecodingError(field, "no token sequence of this vocabulary matches it")
    with self._lock:
      self._cache[regex] = grammar
      while len(self._cache) > self._cache_size:
        self._cache.popitem(last=False)
    return grammar


__all__ = [
  "Grammar",
  "GrammarCompiler",
  "GuidedDecodingError",
  "GuidedMatcher",
  "GuidedSpec",
  "ReasoningGate",
  "spec_from_request",
  "spec_regex",
  "unpack_bits",
]
