"""Hostile output constraints against a real server of the embedded model: each is a 400
naming its field or a 200, never a 500; the replica's worker lives on (same pid, no
restart) with bounded memory, and the event loop keeps answering meanwhile.

Compiling does not depend on the backend (it happens beside the engine, on the replica's
compiler), so this runs on one backend."""

from __future__ import annotations

import asyncio
import json
import string
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import FRONT_END_BACKENDS, ServerProcess, runtime, serving, smollm_manifest
from hostile_schemas import ref_chain, ref_nesting
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laya_core.logs import resident_bytes
from laya_core.structured.sandbox import CompileLimits

ASK = [{"role": "user", "content": "Say something."}]
SCHEMA = "response_format.json_schema.schema"


def with_schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


# The cases: each crashed the replica (SIGSEGV), froze the server, grew the worker
# by 150-200 MiB, answered 500 after 22-38 s, or 200 with empty content.
HOSTILE: list[tuple[dict[str, Any], str]] = [
    (with_schema(ref_chain(5000)), SCHEMA),
    (with_schema(ref_nesting(1000)), SCHEMA),
    (with_schema({"enum": [f"v{i}" for i in range(100_000)]}), SCHEMA),
    (with_schema({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(10_000)}}), SCHEMA),
    (with_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), SCHEMA),
    (with_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                                 "b": {"$ref": "#/$defs/a"}}}), SCHEMA),
    ({"guided_grammar": "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(5000))
      + 'r5000: "a"\n'}, "guided_grammar"),
    ({"guided_grammar": "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "x"\n'
                                                  for i in range(3000)) + 'r3000 ::= "a"\n'},
     "guided_grammar"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex"),
    ({"guided_regex": "x" * 3_000_000}, "guided_regex"),
    ({"structured_outputs": {"choice": [f"{i:04d}" + "c" * 396 for i in range(4096)]}},
     "structured_outputs.choice"),
    ({"guided_regex": r"[^\x00-\x{10FFFF}]"}, "guided_regex"),
]


@pytest.fixture(scope="module", params=FRONT_END_BACKENDS)
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serving(smollm_manifest(request.param),
                 tmp_path_factory.mktemp(f"hostile_constraints_{request.param}")) as s:
        s.backend = request.param
        yield s


def worker(server: ServerProcess) -> tuple[int, int, int]:
    """The replica's worker: pid, restarts, resident bytes."""
    info = runtime(server)
    rss = resident_bytes(info["pid"])
    assert rss is not None
    return info["pid"], info["restarts"], rss


def ask(client: httpx.Client, extra: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": "smollm2", "messages": ASK, "max_tokens": 4, **kwargs, **extra})


def answered_well(r: httpx.Response, params: tuple[str, ...]) -> None:
    """A 200 that finished, or a 400 whose ``param`` is the constraint's field."""
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"].startswith(params), r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


def test_each_hostile_constraint_is_a_400_and_the_worker_lives(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        # The first constraint builds the vocabulary's index (25 MiB): before measuring.
        assert ask(client, {"guided_regex": "(yes|no)"}).status_code == 200
        pid, restarts, rss = worker(server)
        for body, param in HOSTILE:
            r = ask(client, body)
            assert r.status_code == 400, (param, r.text[:300])
            assert r.json()["error"]["param"] == param, r.text[:300]
        streamed = ask(client, HOSTILE[0][0], stream=True)
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == SCHEMA
        good = ask(client, {"guided_regex": "(yes|no|maybe)"})
        assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] \
            in ("yes", "no", "maybe")
    after_pid, after_restarts, after_rss = worker(server)
    assert (after_pid, after_restarts) == (pid, restarts)
    # Compiled in the child, refused there: the worker holds at most one compile's worth
    # more (it held 150-200 MiB more per heavy regex when they compiled in it).
    assert after_rss - rss < CompileLimits().memory_bytes, (rss, after_rss)


def test_distinct_heavy_regexes_do_not_grow_the_worker(server: ServerProcess) -> None:
    _, _, rss = worker(server)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(1, 4):
            r = ask(client, {"guided_regex": f"(b{{{i}}}a{{1000}}){{1000}}"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    _, _, after = worker(server)
    assert after - rss < CompileLimits().memory_bytes, (rss, after)


def test_the_event_loop_answers_while_hostile_constraints_arrive(server: ServerProcess) -> None:
    # Regexes no other test sent (a refusal is cached): each costs the compile child about
    # a second; the GBNF grammar froze the loop for 23 s when it was converted there.
    fresh = [{"guided_regex": f"(c{{{i}}}a{{1000}}){{1000}}"} for i in range(1, 4)]
    bodies = [*fresh, HOSTILE[7][0], HOSTILE[3][0], HOSTILE[11][0]]

    async def go() -> tuple[list[httpx.Response], list[float]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            posts = asyncio.gather(*(client.post("/v1/chat/completions", json={
                "model": "smollm2", "messages": ASK, "max_tokens": 4, **body})
                for body in bodies))
            health = []
            while not posts.done():
                start = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                health.append(time.perf_counter() - start)
                await asyncio.sleep(0.02)
            return await posts, health

    responses, health = asyncio.run(go())
    assert [r.status_code for r in responses] == [400] * len(bodies)
    # Probes answered one after another while the bodies were refused: a loop blocked by
    # them would answer one between two; how long each took is the machine's load.
    assert len(health) >= 3, health


# -- fuzz ----------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "name", "x y", "$ref", "type", ""])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.text(max_size=8), st.sampled_from([10**9, -1, 0.5]))
REGEX_TEXT = st.text(alphabet="ab.()[]{}|*+?^$\\-,0123456789dws", max_size=24)


def schemas() -> st.SearchStrategy[Any]:
    leaf = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(
            ["string", "integer", "number", "boolean", "null", "object", "array", "nope"])}),
        st.fixed_dictionaries({"enum": st.lists(SCALARS, max_size=5)}),
        st.fixed_dictionaries({"const": SCALARS}),
        st.fixed_dictionaries({"type": st.just("string"), "pattern": REGEX_TEXT}),
        st.fixed_dictionaries({"type": st.just("string"),
                               "minLength": st.integers(-2, 10**6),
                               "maxLength": st.integers(-2, 10**6)}),
        st.fixed_dictionaries({"type": st.just("integer"),
                               "minimum": st.integers(-10**12, 10**12),
                               "maximum": st.integers(-10**12, 10**12)}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/a", "#/nope", "x"])}),
        st.sampled_from([{}, {"format": "date-time"}, {"uniqueItems": True},
                         {"type": "string", "format": "email"}]),
    )
    return st.recursive(leaf, lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(NAMES, inner, max_size=4),
                               "required": st.lists(NAMES, max_size=3),
                               "additionalProperties": st.one_of(st.booleans(), inner)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner,
                               "minItems": st.integers(0, 5), "maxItems": st.integers(0, 5)}),
        st.builds(lambda key, options: {key: options},
                  st.sampled_from(["anyOf", "oneOf", "allOf"]), st.lists(inner, max_size=3)),
        st.fixed_dictionaries({"$ref": st.just("#/$defs/a"),
                               "$defs": st.fixed_dictionaries({"a": inner})}),
    ), max_leaves=8)


GRAMMAR_TEXT = st.one_of(
    st.builds(lambda rules: "start: " + "\n".join(rules), st.lists(
        st.text(alphabet=string.ascii_lowercase[:4] + ' :|"()*+?/[]%\n', max_size=20),
        min_size=1, max_size=5)),
    st.builds(lambda rules: "root ::= " + "\n".join(rules), st.lists(
        st.text(alphabet=string.ascii_lowercase[:4] + ' :=|"()*+?[]^-\n', max_size=20),
        min_size=1, max_size=5)),
)
CONSTRAINTS = st.one_of(
    st.builds(lambda s: (with_schema(s), (SCHEMA, "response_format")), schemas()),
    st.builds(lambda s: ({"guided_json": json.dumps(s)}, ("guided_json",)), schemas()),
    st.builds(lambda r: ({"guided_regex": r}, ("guided_regex",)), REGEX_TEXT),
    st.builds(lambda g: ({"guided_grammar": g}, ("guided_grammar",)), GRAMMAR_TEXT),
    st.builds(lambda c: ({"structured_outputs": {"choice": c}},
                         ("structured_outputs.choice",)), st.lists(st.text(max_size=6),
                                                                   max_size=4)),
)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(constraint=CONSTRAINTS)
def test_fuzzed_constraints_are_a_200_or_a_400_naming_the_field(
        server: ServerProcess, constraint: tuple[dict[str, Any], tuple[str, ...]]) -> None:
    body, params = constraint
    with httpx.Client(base_url=server.url, timeout=60) as client:
        answered_well(ask(client, body, temperature=0), params)


def test_the_worker_is_the_same_after_the_fuzz(server: ServerProcess) -> None:
    """Run after the tests above (pytest keeps a module's order): no worker restarted."""
    info = runtime(server)
    assert info["restarts"] == 0, info
