"""Broken third-party plugins, installed as packages are (a dist-info with a ``laya`` entry
point on the path): each is left out and named with its package and the hook, the others
load, ``laya plugins`` and ``laya check`` exit 2, and a model that needs one says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from laya_core.hookspecs import hookimpl
from laya_core.plugins import load_registry

BROKEN = {
    # package name -> (module source, what the report must say)
    "import-fails": ("import no_such_module_anywhere\n", "ModuleNotFoundError"),
    "hook-raises": ("from laya_core.hookspecs import hookimpl\n"
                    "@hookimpl\ndef register_schedulers(register):\n"
                    "    register('never', object)\n"
                    "    raise RuntimeError('no scheduler today')\n",
                    "in hook register_schedulers: RuntimeError: no scheduler today"),
    "name-taken": ("from laya_core.hookspecs import hookimpl\n"
                   "from laya_core.engine.scheduler import FcfsScheduler\n"
                   "@hookimpl\ndef register_schedulers(register):\n"
                   "    register('fcfs', FcfsScheduler)\n",
                   "'fcfs' is registered twice: by builtin"),
    "misspelt-hook": ("from laya_core.hookspecs import hookimpl\n"
                      "@hookimpl\ndef register_backend(register):\n    pass\n",
                      "register_backend, which Laya has no hook spec for"),
}


def install(site: Path, package: str, source: str) -> None:
    """What pip leaves for a package: its module and a dist-info naming the entry point."""
    module = package.replace("-", "_")
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[laya]\n{module} = {module}\n")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    for package, (source, _) in BROKEN.items():
        install(site, package, source)
    return site


def laya(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    return subprocess.run([sys.executable, "-m", "laya_core.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # runs the laya command
def test_laya_plugins_names_each_broken_package_and_lists_the_rest(site: Path) -> None:
    run = laya(site, "plugins")
    assert run.returncode == 2, run.stdout + run.stderr
    for package, (_, says) in BROKEN.items():
        lines = [ln for ln in run.stdout.splitlines() if f"{package} 1.0" in ln]
        assert len(lines) == 1 and says in lines[0], (package, run.stdout)
    assert "fcfs           builtin" in run.stdout  # the taken name keeps its first owner
    assert "never" not in run.stdout  # what a raising hook registered is dropped
    assert "llamacpp       laya-backend-llamacpp" in run.stdout


@pytest.mark.slow  # runs the laya command
def test_laya_check_reports_them_with_status_2_and_still_checks(site: Path,
                                                                tmp_path: Path) -> None:
    run = laya(site, "check", "embedded:smollm2-135m-instruct")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "ok: " in run.stdout
    assert "plugin error: import-fails 1.0 (entry point import_fails) failed while loading: " \
        "ModuleNotFoundError" in run.stderr
    manifest = tmp_path / "laya.toml"
    manifest.write_text('[[models]]\nname = "m"\npath = "embedded:smollm2-135m-instruct"\n'
                        'scheduler = "never"\n')
    run = laya(site, "check", str(manifest))
    assert run.returncode == 2
    assert "models[0].scheduler: no scheduler 'never' is installed" in run.stderr
    assert "perhaps the one: " in run.stderr and "no scheduler today" in run.stderr


@pytest.mark.slow  # runs the laya command
def test_trace_hooks_logs_each_call_with_its_plugin_and_duration(site: Path) -> None:
    run = laya(site, "check", "--trace-hooks", "embedded:smollm2-135m-instruct")
    traced = [ln for ln in run.stderr.splitlines() if "laya.hooks" in ln]
    schedulers = [ln for ln in traced if "hook register_schedulers(register)" in ln]
    assert any("laya_core.builtin.schedulers" in ln and " ms" in ln for ln in schedulers)
    assert any("hook-raises 1.0" in ln and "raised RuntimeError" in ln for ln in schedulers)
    assert any("hook resolve_model_path(path)" in ln for ln in traced)
    assert not [ln for ln in laya(site, "check", "embedded:smollm2-135m-instruct")
                .stderr.splitlines() if "laya.hooks" in ln]


def test_a_plugin_in_code_that_raises_is_left_out_too() -> None:
    class Raises:
        @hookimpl
        def register_routers(self, register):  # type: ignore[no-untyped-def]
            raise ValueError("broken router table")

    registry = load_registry([Raises()])
    (failure,) = registry.failures
    assert failure.hook == "register_routers" and "broken router table" in failure.error
    assert "python" in registry.routers
