"""The front end speaks the protocol without the child's module, and refusals round-trip."""

import subprocess
import sys

import pytest

from laya_core.engine.limits import RequestTooLongError
from laya_core.engine.state import QueueFullError
from laya_core.replica.protocol import refusal_of, refused
from laya_core.structured.spec import GrammarError


@pytest.mark.slow  # a fresh interpreter
def test_the_front_end_never_imports_the_childs_module() -> None:
    code = ("import sys, laya_core.serving.deployment, laya_core.replica.ray_client; "
            "print(sorted(m for m in sys.modules if m in "
            "('laya_core.replica.worker', 'laya_core.replica.ray_actor')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("error", [QueueFullError("full"), RequestTooLongError("long"),
                                   ValueError("bad"), GrammarError("response_format", "no")])
def test_a_refusal_crosses_as_the_same_error(error: Exception) -> None:
    back = refused(*refusal_of(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)
