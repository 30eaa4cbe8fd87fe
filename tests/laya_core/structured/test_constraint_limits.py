"""Hostile output constraints: refused with the field named, in this process or in the
compiler's child, never by crashing, hanging or growing the process that serves.

Real llguidance throughout, on the toy vocabulary (bytes as tokens: its child starts in
about 0.2 s, so a test that kills it stays fast)."""

from __future__ import annotations

import json
import os
from typing import Any

import llguidance
import pytest
from hostile_schemas import ref_chain, ref_nesting
from toy_backend import END, ToyTokenizer

from laya_core.backend import ModelInfo
from laya_core.structured import formats, precheck
from laya_core.structured.compiler import GrammarCompiler
from laya_core.structured.sandbox import CompileLimits
from laya_core.structured.spec import ConstraintSpec, GrammarError

TOY_INFO = ModelInfo(n_ctx_train=512, vocab_size=257, eog_token_ids=frozenset({END}),
                     chat_template=None, bos_token="", eos_token="", add_bos=False)
SCHEMA = "response_format.json_schema.schema"


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def with_schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


# Each of these crashed, froze or bloated a replica before it was refused up front.
REFUSED_UP_FRONT = {
    "ref_chain_5000": (with_schema(ref_chain(5000)), SCHEMA, "deeper than 128"),
    "ref_nesting_1000": (with_schema(ref_nesting(1000)), SCHEMA, "deeper than 128"),
    "enum_100000": (with_schema({"enum": list(range(100_000))}), SCHEMA, "enum values"),
    "properties_10000": (with_schema({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(10_000)}}), SCHEMA, "properties"),
    "self_ref": (with_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
                 SCHEMA, "leads back to itself"),
    "mutual_ref": (with_schema({"$ref": "#/$defs/a", "$defs": {
        "a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}), SCHEMA,
        "leads back to itself"),
    "lark_5000_rules": ({"guided_grammar": lark_chain(5000)}, "guided_grammar", "rules"),
    "gbnf_3000_rules": ({"guided_grammar": "root ::= r0\n" + "".join(
        f'r{i} ::= r{i + 1} "x"\n' for i in range(3000)) + 'r3000 ::= "a"\n'},
        "guided_grammar", "rules"),
    "a_1000000": ({"guided_regex": "a{1000000}"}, "guided_regex", "repetition"),
    "regex_3mb": ({"guided_regex": "x" * 3_000_000}, "guided_regex", "characters"),
    "choices_4096x400": ({"structured_outputs": {"choice": [
        f"{i:04d}" + "c" * 396 for i in range(4096)]}}, "structured_outputs.choice",
        "characters"),
    "schema_string_deep": ({"guided_json": "[" * 100_000}, "guided_json", "nests"),
    "pattern_repeat": (with_schema({"type": "string", "pattern": "(ab){99999}"}), SCHEMA,
                       "repetition"),
    "whitespace_repeat": ({"structured_outputs": {"json": {"type": "object"},
                                                  "whitespace_pattern": " {0,100000}"}},
                          "structured_outputs.whitespace_pattern", "repetition"),
}


@pytest.mark.parametrize("name", sorted(REFUSED_UP_FRONT))
def test_obviously_hostile_constraints_are_refused_before_compiling(name: str) -> None:
    body, param, words = REFUSED_UP_FRONT[name]
    with pytest.raises(GrammarError) as e:
        formats.from_body(body)
    assert e.value.param == param
    assert words in str(e.value) and param in str(e.value)


def test_the_checks_take_what_fits_and_recursive_schemas() -> None:
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    precheck.check_schema(tree, "p")
    precheck.check_schema(ref_nesting(40), "p")  # 3 levels of JSON per hop: 121 in all
    precheck.check_grammar(lark_chain(998), "p")
    precheck.check_grammar("root ::= a\n" * 1000, "p")  # GBNF lines count once each
    precheck.check_text("a{10000}", "p")
    with pytest.raises(GrammarError, match="at most 10,000"):
        precheck.check_text("a{10001}", "p")
    with pytest.raises(GrammarError, match="values"):  # the walk's own bound
        precheck.check_schema({"anyOf": [{"a": [[]]} for _ in range(10_000)]}, "p")


@pytest.fixture(scope="module")
def compiler() -> Any:
    c = GrammarCompiler(ToyTokenizer(), TOY_INFO, limits=CompileLimits(timeout_s=1.0))
    yield c
    c.close()


def refused(compiler: GrammarCompiler, spec: ConstraintSpec) -> str:
    with pytest.raises(GrammarError) as e:
        compiler.constraint(spec)
    assert e.value.param == spec.param
    return str(e.value)


def raw(kind: str, source: Any) -> ConstraintSpec:
    """A spec straight from llguidance, past the request's checks: what the child is for."""
    if kind == "regex":
        return ConstraintSpec(kind, llguidance.LLMatcher.grammar_from_regex(source), "p")
    if kind == "json":
        return ConstraintSpec(kind, llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(source)), "p")
    return ConstraintSpec(kind, llguidance.LLMatcher.grammar_from_lark(source), "p")


def test_a_grammar_that_crashes_the_compiler_costs_only_its_request(
        compiler: GrammarCompiler) -> None:
    """llguidance overflows its stack (SIGSEGV) on these, in any process; here the child
    dies, the request gets a 400, and the next grammar compiles in a fresh child."""
    restarts = compiler.sandbox.num_restarts
    for spec in (raw("json", ref_chain(5000)), raw("lark", lark_chain(5000))):
        assert "crashed the compiler" in refused(compiler, spec)
    assert compiler.sandbox.num_restarts == restarts + 2
    compiler.constraint(formats.regex("[a-c]+", "p"))
    assert compiler.sandbox.pid is not None and compiler.sandbox.pid != os.getpid()


def test_compiling_yields_the_cpu_to_generation(compiler: GrammarCompiler) -> None:
    """A hostile compile on a busy machine stalled a neighbour's stream for seconds; the
    child runs at a nice value 10 above this process's (at most 19)."""
    compiler.constraint(formats.regex("[0-9]+", "p"))
    ours, pid = os.getpriority(os.PRIO_PROCESS, 0), compiler.sandbox.pid
    assert pid is not None
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(ours + compiler.limits.nice, 19)


# Which limit a compile meets first, 1 s or 48 MiB, depends on a free core: alone.
@pytest.mark.serial
def test_a_compile_past_its_time_or_memory_is_refused(compiler: GrammarCompiler) -> None:
    # Converting GBNF is quadratic in the rules: 3,000 took 6.3 s, these about 25 s.
    gbnf = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "x"\n' for i in range(6000))
    slow = ConstraintSpec("grammar", gbnf + 'r6000 ::= "a"\n', "p", convert=True)
    assert "longer than 1 s" in refused(compiler, slow)
    big = raw("regex", "(a{1000}){1000}")  # its regex states grow past 48 MiB
    assert "more than the 48 MiB" in refused(compiler, big)
    assert "larger or costlier" in refused(compiler, raw("regex", "a{1000000}"))


def test_refusals_are_cached_and_stable(compiler: GrammarCompiler) -> None:
    spec = raw("regex", "(b{3}a{1000}){1000}")
    first = refused(compiler, spec)
    compiled, restarts = compiler.compiled, compiler.sandbox.num_restarts
    assert refused(compiler, spec) == first
    assert (compiler.compiled, compiler.sandbox.num_restarts) == (compiled, restarts)


def test_a_constraint_nothing_satisfies_is_refused(compiler: GrammarCompiler) -> None:
    for spec in (formats.regex(r"[^\x00-\x{10FFFF}]", "p"),
                 raw("json", {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})):
        assert "no output satisfies it" in refused(compiler, spec)


def test_a_gbnf_grammar_is_converted_in_the_child(compiler: GrammarCompiler) -> None:
    spec = formats.grammar('root ::= "a" [0-9]+', "guided_grammar")
    assert spec.convert and spec.grammar == 'root ::= "a" [0-9]+'  # untouched on the loop
    mask = compiler.constraint(spec)([])
    assert mask.token_ids().tolist() == [ord("a")]
    assert "not a Lark or GBNF" in refused(compiler, formats.grammar("root ::= (", "p"))


def test_4096_choices_compile_and_each_is_allowed(compiler: GrammarCompiler) -> None:
    options = [f"option {i}" for i in range(4096)]
    spec = formats.choice(options, "guided_choice")
    for option in (options[0], options[-1]):
        mask = compiler.constraint(spec)(list(option.encode()))
        assert END in mask.token_ids().tolist()


def test_the_cache_is_bounded_in_bytes() -> None:
    compiler = GrammarCompiler(ToyTokenizer(), TOY_INFO)
    try:
        compiler.cache_bytes = 3 * compiler.growth_bytes + 2**20
        for i in range(8):
            compiler.constraint(formats.regex(f"item{i}-[a-z]+", "p"))
            assert compiler.cached_bytes <= compiler.cache_bytes
        assert len(compiler._cache) == 3
        compiled = compiler.compiled
        compiler.constraint(formats.regex("item7-[a-z]+", "p"))  # the newest: still kept
        assert compiler.compiled == compiled
        compiler.constraint(formats.regex("item0-[a-z]+", "p"))  # evicted: compiled again
        assert compiler.compiled == compiled + 1
    finally:
        compiler.close()


class _WaitingMatcher:
    """A matcher whose masks wait ``wait_s`` off the CPU, then burn ``burn_s`` on it,
    allowing every token."""

    def __init__(self, wait_s: float, burn_s: float) -> None:
        self.wait_s, self.burn_s = wait_s, burn_s

    def compute_bitmask(self) -> bytes:
        import time

        time.sleep(self.wait_s)
        end = time.thread_time() + self.burn_s
        while time.thread_time() < end:
            pass
        return b"\xff" * 36

    def is_error(self) -> bool:
        return False

    def consume_token(self, token: int) -> None:
        pass


def test_a_mask_is_timed_on_the_cpu_not_the_wall_clock() -> None:
    """The child is niced: on a busy machine it waits for a core. Waiting is not the
    grammar's cost, and must not refuse it (a 66 ms wait refused a one-tool grammar
    whose masks take 1 ms)."""
    from laya_core.structured import sandbox_child

    job = {"eos": [END], "first_masks": 3, "n_vocab": 257}
    waited = sandbox_child._walk(_WaitingMatcher(0.12, 0.0), job)  # type: ignore[arg-type]
    burned = sandbox_child._walk(_WaitingMatcher(0.0, 0.12), job)  # type: ignore[arg-type]
    assert isinstance(waited, float) and isinstance(burned, float)
    limit = CompileLimits().max_mask_s
    assert waited < limit < burned
