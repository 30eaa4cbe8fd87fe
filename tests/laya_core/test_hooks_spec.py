"""spec/hooks.md is the reference plugin authors read: every hook spec has its entry, with
the exact signature, whether it is firstresult, and a test of its own that exists; every
public member of the Backend contract is documented."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from laya_core import hookspecs
from laya_core.backend import Backend

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "spec" / "hooks.md").read_text(encoding="utf-8")
HOOKS = sorted(name for name, f in vars(hookspecs).items()
               if callable(f) and hasattr(f, f"{hookspecs.PROJECT_NAME}_spec"))


def entry(hook: str) -> str:
    """The hook's section: from its ### heading to the next heading."""
    found = re.search(rf"^### `{hook}\(.*?(?=^##)", SPEC, re.S | re.M)
    assert found, f"spec/hooks.md has no ### entry for the hook {hook}"
    return found.group(0)


def test_the_hooks_are_found() -> None:
    assert {"register_backends", "resolve_model_path"} <= set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_its_entry_with_the_exact_signature(hook: str) -> None:
    text = entry(hook)
    heading = text.splitlines()[0]
    spec = getattr(hookspecs, hook)
    signature = inspect.signature(spec)
    params = ", ".join(f"{n}: {p.annotation}" for n, p in signature.parameters.items())
    assert heading == f"### `{hook}({params}) -> {signature.return_annotation}`", heading


@pytest.mark.parametrize("hook", HOOKS)
def test_every_entry_says_firstresult_and_gives_an_example(hook: str) -> None:
    text = entry(hook)
    firstresult = getattr(getattr(hookspecs, hook),
                          f"{hookspecs.PROJECT_NAME}_spec")["firstresult"]
    assert f"**firstresult**: {'yes' if firstresult else 'no'}" in text
    assert "**when**:" in text and "**returns**:" in text
    assert "```python\n@hookimpl\n" in text  # a minimal implementation


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test_of_its_own(hook: str) -> None:
    tested = re.search(r"\*\*tested by\*\*: `(tests/[^`:]+)::(test_\w+)`", entry(hook))
    assert tested, f"the entry of {hook} names no test"
    path, name = ROOT / tested.group(1), tested.group(2)
    assert path.is_file(), path
    functions = {n.name for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.FunctionDef)}
    assert name in functions, f"{tested.group(0)} does not exist"
    assert hook in path.read_text(), f"{path} never mentions {hook}"


def test_every_public_member_of_the_backend_contract_is_documented() -> None:
    members = [n for n in vars(Backend) if not n.startswith("_")] + ["name"]
    missing = [n for n in members if not re.search(rf"`{n}\b", SPEC)]
    assert not missing, f"spec/hooks.md does not document Backend.{missing}"
