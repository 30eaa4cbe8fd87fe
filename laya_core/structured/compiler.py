"""Constraint specs compiled into matchers, once per grammar, and the engine's view of one.

A :class:`GrammarCompiler` belongs to one loaded model's tokenizer. It builds llguidance's
view of the vocabulary on first use (each token's bytes, the special tokens, the
end-of-generation ids: 0.3 s for 49,152 tokens on AMD EPYC). Each new grammar text is first
compiled and walked in the replica's child process (:mod:`laya_core.structured.sandbox`),
where a native crash, a compile that never ends or one that needs hundreds of MiB costs that
request a 400 and nothing else; what passes is compiled here, with the same llguidance
limits, on a thread with a stack four times the child's, and kept in an LRU cache bounded
in bytes: each entry counts what the child measured its matcher to hold, plus the lexer
states it may still build (they are shared by every copy, and grow as requests use it). A
request gets a copy of the matcher (``deep_copy``: about 1 us). Compiling blocks its caller,
which is never the engine's thread: the engine client calls :meth:`GrammarCompiler.
constraint` from a worker thread. One grammar text compiles once at a time; requests that
send it meanwhile wait for that compile.

A :class:`MatcherConstraint` is what the engine calls before each token the sequence
samples (a :data:`~laya_core.engine.allowed_tokens.TokenConstraint`): it feeds the matcher the
tokens generated since the last call and returns the next mask. A JSON constraint has two
matchers, the schema's and one that bounds the digits of its numbers
(:attr:`ConstraintSpec.numbers`, Laya's own regular expression: compiled here, not in the
child), and a token must be allowed by both. Measured for that
vocabulary (AMD EPYC): a mask takes 17 us at the median, about 0.1 ms at p99; the limits
bound one mask's work to about 8 ms.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import queue
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import numpy as np

from laya_core.engine.allowed_tokens import AllowedTokens
from laya_core.logs import start_named
from laya_core.structured.sandbox import CompileLimits, CompileSandbox, Refused, Vocabulary
from laya_core.structured.spec import ConstraintSpec, GrammarError

if TYPE_CHECKING:
    import llguidance

    from laya_core.backend import ModelInfo
    from laya_core.models.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept per model, at most
CACHE_BYTES = 64 * 2**20  # ... and the bytes they may hold
LEXER_STATE_BYTES = 640  # measured: 10,000 states of one regex's lexer held 5.8 MiB
MAX_GRAMMAR_CHARS = 2**20  # a grammar's text, tools' included (the request's checks: 256 KiB)
_STACK_FACTOR = 4  # the compile thread's stack, over the child's

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
# llguidance's words when a grammar passes one of its ParserLimits.
_LIMITS = re.compile(r"too many|too big|too large|max is|fuel|limit", re.IGNORECASE)
T = TypeVar("T")


def explain(param: str, refused: Refused) -> GrammarError:
    """Why a constraint cannot be used, as a client's error: the field, and the keywords
    llguidance names."""
    error = refused.reason.strip()
    if not refused.matcher:
        return GrammarError(param, f"'{param}' cannot be used as an output constraint: {error}")
    found = _UNIMPLEMENTED.search(error)
    if found:
        keywords = ", ".join(k.strip().strip('"') for k in found.group(1).split(","))
        return GrammarError(param, f"'{param}' uses the JSON-schema keyword(s) {keywords}, "
                            "which this server cannot enforce; remove them (the output "
                            f"would not be guaranteed to satisfy them) ({error})")
    if "look-around" in error:
        return GrammarError(param, f"'{param}' uses a regular-expression look-around "
                            "((?=...), (?!...), (?<=...) or (?<!...)), which this server "
                            f"cannot enforce ({error.splitlines()[-1].strip()})")
    first = error.split("\n<state>")[0].strip()  # not the parser's dump of its state
    if first == "NoExtensionBias":  # the first mask allows no token: an empty language
        return GrammarError(param, f"'{param}' cannot be used as an output constraint: no "
                            f"output satisfies it ({first})")
    if _LIMITS.search(first):
        return GrammarError(param, f"'{param}' cannot be used as an output constraint: it "
                            f"is larger or costlier than this server's limits allow ({first})")
    return GrammarError(param, f"'{param}' cannot be compiled into a constraint: {first}")


class _Vocabulary:
    """The object llguidance's ``TokenizerWrapper`` reads a vocabulary from."""

    def __init__(self, tokenizer: Tokenizer, info: ModelInfo) -> None:
        self._tokenizer = tokenizer
        specials: dict[int, bytes] = {}
        for text in info.special_tokens:
            ids = tokenizer.encode(text, add_special=False, parse_special=True)
            if len(ids) == 1:
                specials[ids[0]] = text.encode()
        self.special_token_ids = sorted(specials)
        # Control tokens have no text of their own (token_bytes gives b""): llguidance
        # marks special ids itself and wants their names. A model whose output rows are
        # wider than its tokenizer's vocabulary (padded embeddings) has ids past it that
        # no text maps to: they are never allowed.
        self.tokens = [specials.get(i) or tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * max(info.vocab_size - len(self.tokens), 0)
        self.eog = sorted(info.eog_token_ids)
        self.eos_token_id = self.eog[0] if self.eog else 0
        self.bos_token_id = None

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


@attrs.frozen
class _Compiled:
    matcher: Any  # llguidance.LLMatcher, the cache's own: requests get copies
    num_bytes: int  # what it is counted as holding, now and as it grows
    numbers: Any = None  # the matcher of the spec's ``numbers`` grammar, if it has one


class _StackThread:
    """One thread with a stack of a chosen size and a lower priority (``nice`` added),
    running the functions it is given."""

    def __init__(self, stack_bytes: int, nice: int) -> None:
        self._nice = nice
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = \
            queue.SimpleQueue()
        # threading.stack_size is process-wide: a thread another one starts meanwhile gets
        # this size too, which costs it address space only.
        old = threading.stack_size(stack_bytes)
        try:
            start_named(threading.Thread(target=self._run, name="laya-grammar-compile",
                                         daemon=True), "laya-grammar")
        finally:
            threading.stack_size(old)

    def _run(self) -> None:
        # Linux's nice values are per thread: compiling yields the CPU to the engine's steps,
        # as the compile child does (laya_core/structured/sandbox_child.py).
        with contextlib.suppress(OSError, AttributeError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self._nice)
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller's to raise
                future.set_exception(e)

    def call(self, fn: Callable[[], T]) -> T:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future.result()


class GrammarCompiler:
    """Compiles constraint specs for one model's vocabulary; safe from any thread."""

    def __init__(self, tokenizer: Tokenizer, info: ModelInfo, cache_size: int = CACHE_SIZE,
                 cache_bytes: int = CACHE_BYTES, limits: CompileLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self._info = info
        self.limits = limits or CompileLimits()
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._sandbox: CompileSandbox | None = None
        self._thread: _StackThread | None = None
        self._cache: collections.OrderedDict[tuple[bool, bytes], _Compiled | Refused] = \
            collections.OrderedDict()
        self._compiling: dict[tuple[bool, bytes], Future[_Compiled | Refused]] = {}
        self._cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0  # what the cache's entries are counted as holding
        self.compiled = 0  # grammars compiled (cache misses), for tests and benchmarks

    @property
    def vocab_size(self) -> int:
        """The mask's width: the model's output rows (``ModelInfo.vocab_size``)."""
        return max(self._info.vocab_size, self._tokenizer.vocab_size)

    @property
    def growth_bytes(self) -> int:
        """What a cached matcher may still grow by: its lexer's states, at most."""
        return self.limits.max_lexer_states * LEXER_STATE_BYTES

    @property
    def sandbox(self) -> CompileSandbox:
        self._vocabulary()
        assert self._sandbox is not None
        return self._sandbox

    def _vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                import llguidance

                vocab = _Vocabulary(self._tokenizer, self._info)
                self._lltokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(vocab), n_vocab=self.vocab_size,
                    eos_token=vocab.eog or None)
                self._sandbox = CompileSandbox(
                    Vocabulary(vocab.tokens, vocab.special_token_ids, vocab.eog), self.limits)
                self._thread = _StackThread(self.limits.stack_bytes * _STACK_FACTOR,
                                           self.limits.nice)
            return self._lltokenizer

    def matcher(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``'s grammar; raises :class:`GrammarError` when it cannot
        be used (that answer is cached too)."""
        return self._compiled(spec).matcher.deep_copy()

    def _compiled(self, spec: ConstraintSpec) -> _Compiled:
        # A digest, not the text: a refused grammar of 1 MiB costs the cache 32 bytes.
        text = spec.grammar + ("\0" + spec.numbers if spec.numbers else "")
        key = (spec.convert, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                pending = None
            else:
                pending = self._compiling.get(key)
                if pending is None:
                    self._compiling[key] = Future()
        if found is None:
            found = pending.result() if pending is not None else self._compile_new(key, spec)
        if isinstance(found, Refused):
            for part in spec.parts:  # the part refused alone names its own field
                self._compiled(part)
            raise explain(spec.param, found)
        return found

    def _compile_new(self, key: tuple[bool, bytes], spec: ConstraintSpec) -> _Compiled | Refused:
        try:
            entry: _Compiled | Refused = self._compile(spec)
        except Refused as refused:
            entry = refused
        except BaseException as e:  # not the grammar's fault: nothing to cache
            with self._lock:
                self._compiling.pop(key).set_exception(e)
            raise
        with self._lock:
            self.compiled += 1
            self._keep(key, entry)
            self._compiling.pop(key).set_result(entry)
        return entry

    def _compile(self, spec: ConstraintSpec) -> _Compiled:
        import llguidance

        if len(spec.grammar) > MAX_GRAMMAR_CHARS:
            raise Refused(f"its grammar has more than {MAX_GRAMMAR_CHARS:,} characters")
        vocabulary = self._vocabulary()
        checked = self.sandbox.check(spec.grammar, spec.convert)
        limits = self.limits
        if checked.num_bytes > limits.max_grammar_bytes:
            raise Refused(f"its matcher needs {checked.num_bytes / 2**20:.0f} MiB, more than "
                          f"the {limits.max_grammar_bytes // 2**20} MiB one constraint may hold")
        if checked.mask_s > limits.max_mask_s:
            raise Refused(f"one step of generating under it took {checked.mask_s * 1e3:.0f} "
                          f"ms, more than the {limits.max_mask_s * 1e3:.0f} ms allowed")

        def build(grammar: str) -> Any:  # the child's work again, on a stack it did not need
            matcher = llguidance.LLMatcher(
                vocabulary, grammar, log_level=0,
                limits=llguidance.LLParserLimits(**limits.parser_limits()))
            if not matcher.is_error():
                matcher.compute_bitmask()  # builds the first lexer states, once for all
            return matcher

        assert self._thread is not None
        matcher = self._thread.call(lambda: build(checked.grammar))
        if matcher.is_error():
            raise Refused(matcher.get_error(), matcher=True)
        numbers = None
        if spec.numbers:  # Laya's own regular expression, a few lexer states
            numbers = self._thread.call(lambda: build(spec.numbers))
            if numbers.is_error():
                raise Refused(numbers.get_error(), matcher=True)
        return _Compiled(matcher, checked.num_bytes + self.growth_bytes, numbers)

    def _keep(self, key: tuple[bool, bytes], entry: _Compiled | Refused) -> None:
        """Cache ``entry``, evicting the least recently used past either bound (a refusal
        counts its message; one over the byte bound alone is not kept)."""
        num_bytes = _size(entry)
        if num_bytes > self.cache_bytes:
            return
        self._cache[key] = entry
        self.cached_bytes += num_bytes
        while len(self._cache) > self._cache_size or self.cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self.cached_bytes -= _size(old)

    def constraint(self, spec: ConstraintSpec) -> MatcherConstraint:
        found = self._compiled(spec)
        numbers = found.numbers.deep_copy() if found.numbers is not None else None
        return MatcherConstraint(found.matcher.deep_copy(), self.vocab_size, numbers)

    def close(self) -> None:
        """End the child process (a later compile starts another)."""
        if self._sandbox is not None:
            self._sandbox.close()


def _size(entry: _Compiled | Refused) -> int:
    return entry.num_bytes if isinstance(entry, _Compiled) else len(entry.reason)


class MatcherConstraint:
    """One sequence's matchers as the engine sees them (the grammar's, and the numbers' for
    JSON: a token must be allowed by both); called on the engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 numbers: llguidance.LLMatcher | None = None) -> None:
        self._matcher = matcher
        self._matchers = [matcher] + ([numbers] if numbers is not None else [])
        self._vocab_size = vocab_size
        self._fed = 0
        self._words = (vocab_size + 31) // 32

    def __call__(self, generated: Sequence[int]) -> AllowedTokens:
        self._feed(generated)
        return self._mask(self._matchers)

    def along(self, generated: Sequence[int], draft: Sequence[int]) -> list[AllowedTokens]:
        """The masks of a drafted step's rows: the token after ``generated``, then the one
        after each draft token, for as long as each draft token is allowed where it stands
        (a draft cut there: the rest could never be kept). The draft is walked on copies of
        the matchers (``deep_copy``, about 6 us each), so the sequence's own stay where
        ``generated`` left them and take whichever draft tokens the model keeps as they
        take any token. (Not ``rollback``: a matcher that has stopped at the grammar's end
        takes an end token as nothing, and rolling that back undid the token before it.)"""
        self._feed(generated)
        masks = [self._mask(self._matchers)]
        walkers: list[llguidance.LLMatcher] = []
        for token in draft:
            if not masks[-1].allows(token):
                break
            walkers = walkers or [m.deep_copy() for m in self._matchers]
            if not all([w.consume_token(token) for w in walkers]):
                break
            masks.append(self._mask(walkers))
        return masks

    def _feed(self, generated: Sequence[int]) -> None:
        if len(generated) > self._fed:
            for matcher in self._matchers:
                matcher.consume_tokens(list(generated[self._fed:]))
            self._fed = len(generated)

    def _mask(self, matchers: list[llguidance.LLMatcher]) -> AllowedTokens:
        words = None
        for matcher in matchers:
            if matcher.is_error():
                break
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)[: self._words]
            if matcher.is_error():
                break
            words = mask if words is None else words & mask
        else:
            assert words is not None
            return AllowedTokens(self._vocab_size, words)
        # A step past the matcher's limits (its mask may still allow an end), or an end the
        # grammar does not allow: nothing may follow, and the engine ends the sequence as
        # cut short (finish_reason "length").
        return AllowedTokens(self._vocab_size, np.zeros(self._words, dtype=np.uint32))

    @property
    def is_accepting(self) -> bool:
        """Whether what was generated so far is a complete output of the grammar."""
        return all(m.is_accepting() for m in self._matchers)
