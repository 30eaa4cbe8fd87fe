"""``--threads`` (``LAYA_THREADS``) writes the option the model's backend names for its
compute threads (``Backend.threads_option``): the core knows no option name."""

from __future__ import annotations

from pathlib import Path

import pytest
from toy_backend import ToyBackend

from laya_core.cli.main import build_parser
from laya_core.config import cli_settings
from laya_core.config import manifest as mf
from laya_core.hookspecs import hookimpl
from laya_core.plugins import load_registry


class Workers(ToyBackend):
    name = "workers-toy"
    option_names = frozenset({"workers"})
    threads_option = "workers"


class Plugin:
    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("toy", ToyBackend)  # no threads option
        register(Workers.name, Workers)


def build(tmp_path: Path, *flags: str) -> mf.Manifest:
    args = build_parser().parse_args(["plan", "embedded:smollm2-135m-instruct", *flags])
    manifest, _ = cli_settings.build(args, load_registry([Plugin()]), need_backends=False)
    return manifest


def test_threads_go_to_the_backends_own_option(tmp_path: Path) -> None:
    (model,) = build(tmp_path, "--backend", "workers-toy", "--threads", "3").models
    assert model.options == {"workers": 3}
    (model,) = build(tmp_path, "--backend", "workers-toy", "-t", "auto").models
    assert model.options == {"workers": "auto"}


def test_threads_for_a_backend_without_a_threads_option_are_refused(tmp_path: Path) -> None:
    with pytest.raises(mf.ManifestError) as info:
        build(tmp_path, "--backend", "toy", "--threads", "3")
    assert info.value.key == "--threads"
    assert "the toy backend takes no count of compute threads" in info.value.message


def test_a_plan_for_a_backend_not_installed_prices_only_what_it_knows(tmp_path: Path) -> None:
    from laya_core.memory import planner

    data = {"models": [{"name": "m", "backend": "elsewhere", "kv_cache_dtype": "q8_0",
                        "path": "embedded:smollm2-135m-instruct"}]}
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict(data), registry, need_backends=False)
    with pytest.raises(mf.ManifestError) as info:
        planner.make_plan(manifest, registry)
    assert info.value.key == "models[0].kv_cache_dtype"
    assert "the elsewhere backend, which declares its KV types, is not installed" in \
        info.value.message
