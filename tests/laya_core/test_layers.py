"""laya_core's rooms import downwards only, and no module imports itself back round a cycle.

Every module's imports are read with ``ast``, never by importing it. Three kinds of import:

- *module*: at a module's top level; runs when the module is imported.
- *local*: inside a function; runs when the function is called. It counts as much as a
  module import (hiding an upward import in a function hides it from the reader, not from
  the program), so both are held to the order and to the cycle check.
- *typing*: under ``if TYPE_CHECKING:``; never runs, so it may name a type of a room above
  (the contract's annotations name the engine's ``AllowedTokens``). It is held only to the
  two named rules below, which hold for every import.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import attrs

import laya_core

PACKAGE = Path(laya_core.__file__).parent

# The rooms, lowest first, one line each: why it sits there. A module belongs to the room of
# its longest matching prefix. A module may import its own room and the rooms below it.
ROOMS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("vocabulary", ("laya_core.types", "laya_core.units", "laya_core.logs"),
     "plain values every room speaks (sampling params, samples, usage, byte units) and the "
     "log setup every process (server, worker, Ray actor) shares; imports nothing of Laya"),
    ("models", ("laya_core.models",),
     "what a model file says and the tokenizer interface: headers read, nothing loaded"),
    ("kv", ("laya_core.kv",),
     "the block size and hash chain, KV dtypes, the block pool, cache policies: bookkeeping"),
    ("contract", ("laya_core.backend", "laya_core.backend_types", "laya_core.hookspecs",
                  "laya_core.plugins"),
     "the plugin contract: what a backend is given and reports (in models' and kv's terms), "
     "the hook specs and the registry"),
    ("routing", ("laya_core.routing",),
     "the router contract and the reference router: pure tables, no I/O"),
    ("memory", ("laya_core.memory",),
     "the budget and the ledger, which sums what the backends report against it"),
    ("engine", ("laya_core.engine",),
     "one replica's loop: requests, scheduler, step plans, detokenizer, embed jobs"),
    ("structured", ("laya_core.structured",),
     "structured output compiled to the engine's allowed-token masks"),
    ("replica", ("laya_core.replica",),
     "an engine behind a client: in-process, a worker process or a Ray actor"),
    ("config", ("laya_core.config",),
     "manifest tables and settings, whose defaults name the transports' and routers' own"),
    ("planner", ("laya_core.memory.planner",),
     "the memory plan of a whole manifest: reads the manifest and asks the plugins"),
    ("serving", ("laya_core.serving",),
     "a deployment: the replicas of each model, the router, chat templates"),
    ("http", ("laya_core.http",),
     "the HTTP front end over a deployment"),
    ("builtin", ("laya_core.builtin",),
     "the built-in plugins, which register through the contract as a third party's do"),
    ("cli", ("laya_core.cli",),
     "the command line, which plans and serves"),
    ("testing", ("laya_core.testing",),
     "the conformance kit, which drives a whole deployment"),
)
# The front end runs in the server's process; the worker's module is the child's alone.
FRONT_END = ("laya_core.replica.remote", "laya_core.replica.worker_client",
             "laya_core.replica.ray_client", "laya_core.http")
WORKER = "laya_core.replica.worker"
# The contract is what a backend sees; the ledger sums what backends report, above it.
CONTRACT = ("laya_core.types", "laya_core.units", "laya_core.backend", "laya_core.backend_types",
            "laya_core.hookspecs", "laya_core.plugins")
LEDGER = "laya_core.memory.ledger"


@attrs.frozen
class Import:
    source: str
    target: str
    kind: str  # "module", "local" or "typing"
    line: int

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target} ({self.kind})"


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("laya_core", *path.relative_to(PACKAGE).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = module_names()


def resolve(name: str) -> str | None:
    """The laya_core module ``name`` is or lies in (``a.b.Class`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def imports_of(module: str) -> Iterator[Import]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def names(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            return
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        yield base
        yield from (f"{base}.{alias.name}" for alias in node.names)

    def walk(node: ast.AST, kind: str) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk_stmt(stmt, "typing")
                for stmt in child.orelse:
                    yield from walk_stmt(stmt, kind)
            else:
                yield from walk_stmt(child, kind)

    def walk_stmt(node: ast.AST, kind: str) -> Iterator[Import]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            targets = {resolve(n) for n in names(node) if n.split(".")[0] == "laya_core"}
            for target in sorted(t for t in targets if t and t != module):
                # "from laya_core.kv import pool" names the package and its module: keep the
                # module only, since a package's __init__ is not what the import is about.
                if not any(o.startswith(target + ".") for o in targets if o):
                    yield Import(module, target, kind, node.lineno)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from walk(node, "typing" if kind == "typing" else "local")
        else:
            yield from walk(node, kind)

    yield from walk(ast.parse(path.read_text(), str(path)), "module")


IMPORTS = [imp for module in MODULES for imp in imports_of(module)]
RUNNING = [imp for imp in IMPORTS if imp.kind != "typing"]


def room_of(module: str) -> int:
    best, rank = "", -1
    for i, (_, prefixes, _) in enumerate(ROOMS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    return rank


def under(module: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_every_module_has_a_room() -> None:
    homeless = [m for m in MODULES if m != "laya_core" and room_of(m) < 0]
    assert not homeless, f"modules in no room of ROOMS: {homeless}"


def test_the_reader_sees_imports_of_each_kind() -> None:
    # Guards the reader itself: the shapes of import it must see are all in the tree.
    assert {imp.kind for imp in IMPORTS} == {"module", "local", "typing"}


def test_every_running_import_points_down() -> None:
    upward = [f"{imp}: room {ROOMS[room_of(imp.source)][0]} -> {ROOMS[room_of(imp.target)][0]}"
              for imp in RUNNING if room_of(imp.target) > room_of(imp.source)]
    assert not upward, "imports that point up the order of ROOMS:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in RUNNING:
        graph[imp.source].add(imp.target)
    cycles = [cycle for cycle in strongly_connected(graph) if len(cycle) > 1]
    assert not cycles, "modules that import each other, through running imports: " + \
        "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_front_end_never_imports_the_workers_module() -> None:
    wrong = [str(imp) for imp in IMPORTS if under(imp.source, FRONT_END) and imp.target == WORKER]
    assert not wrong, "the front end imports the worker process's module:\n" + "\n".join(wrong)


def test_the_contract_never_imports_the_ledger() -> None:
    wrong = [str(imp) for imp in IMPORTS if under(imp.source, CONTRACT) and imp.target == LEDGER]
    assert not wrong, "the contract imports the memory ledger:\n" + "\n".join(wrong)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (the graph is ~100 modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    counter = itertools.count()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = next(counter)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = next(counter)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components
