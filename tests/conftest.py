"""Shared fixtures: a real ``laya serve`` process on a loopback port, and small helpers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

# `make test-fast` runs the tests not marked slow: pure logic, in this process, in under a
# minute. Slow are the tests under these folders (they load the model or serve it), those
# that use a fixture below or carry the model or serial marker, and those marked slow by
# hand; a test left unmarked that starts a process (other than the template and grammar
# sandboxes) or imports llama.cpp or torch fails, naming what it started.
SLOW_FOLDERS = frozenset({"integration", "memory", "backend_llamacpp", "backend_torch", "tools",
                          "examples"})
SLOW_FIXTURES = frozenset({"smollm_server", "q4_0_model"})
FAST_MAY_START = ("laya_core.serving.template_sandbox", "laya_core.structured.sandbox")
MODEL_MODULES = ("llama_cpp", "torch")
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if (item.path.relative_to(_TESTS).parts[0] in SLOW_FOLDERS
                or SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or item.get_closest_marker("model") or item.get_closest_marker("serial")):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker on a core of its own, with every process it starts (servers,
    references, tools inherit the affinity). Two workers' backends otherwise share both
    cores: llama.cpp's and torch's threads spin at a barrier per operation, and a thread
    whose core the other worker holds makes its team wait out a scheduler slice. Pinned,
    "auto" threads find one core (engine/threads.py reads the affinity) and never wait on
    the neighbour. The serial tests run without xdist, on every core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    cpus = sorted(os.sched_getaffinity(0))
    if worker.startswith("gw") and 1 < count <= len(cpus):
        share = len(cpus) // count
        index = int(worker[2:]) % count
        os.sched_setaffinity(0, cpus[index * share:(index + 1) * share])


class _FastWatch:
    """What a test not marked slow started or imported, from its setup on."""

    started: list[str] | None = None  # None: the running test is marked slow
    imported_before: frozenset[str] = frozenset()


_popen_init = subprocess.Popen.__init__


def _watched_popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
    if _FastWatch.started is not None:
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        if not any(str(a) in FAST_MAY_START for a in argv):
            _FastWatch.started.append(" ".join(map(str, argv))[:160])
    _popen_init(self, args, *rest, **kw)


subprocess.Popen.__init__ = _watched_popen_init  # type: ignore[method-assign]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    fast = item.get_closest_marker("slow") is None
    _FastWatch.started = [] if fast else None
    _FastWatch.imported_before = frozenset(m for m in MODEL_MODULES if m in sys.modules)


# A fixture shared by every module (this file's, session-scoped) names its scratch folder
# with this prefix, so that the module's own cleanup below leaves it alone.
SESSION_SCRATCH = "session-"


@pytest.fixture(scope="module", autouse=True)
def _module_scratch_freed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Deletes the scratch folders a test module made (copies of the model, Hugging Face
    exports, servers' folders: up to 1 GB a module) once it is over, so that the suite's
    scratch never holds more than one module's beside the shared ones: the whole suite left
    7 GB behind in /tmp otherwise. A test's own ``tmp_path`` goes as it passes
    (``tmp_path_retention_policy = "failed"`` in pyproject.toml)."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    for made in set(base.iterdir()) - before:
        if made.is_dir() and not made.name.startswith(SESSION_SCRATCH):
            shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fast_stays_fast() -> Iterator[None]:
    """Fails a test not marked slow that started a process or imported a model's runtime."""
    yield
    started, _FastWatch.started = _FastWatch.started, None
    if started is None:  # marked slow
        return
    imported = sorted(m for m in MODEL_MODULES
                      if m in sys.modules and m not in _FastWatch.imported_before)
    if started or imported:
        pytest.fail(f"a test outside the slow set started {started or 'nothing'} and imported "
                    f"{imported or 'nothing'}: mark it @pytest.mark.slow (tests/conftest.py)",
                    pytrace=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A ``laya serve`` subprocess; ``url`` is its base address."""

    def __init__(self, manifest_text: str | None, workdir: Path,
                 env: dict[str, str] | None = None, args: Sequence[str] = ()):
        """Serve ``manifest_text`` (``{port}`` filled in), or with None no manifest: then
        ``args`` (a model, flags) say what to serve, and ``--port`` is added."""
        self.port = free_port()
        self.backend = "llamacpp"  # what serves the model, where a test fixture says
        self.url = f"http://127.0.0.1:{self.port}"
        if manifest_text is None:
            command = [*args, "--port", str(self.port)]
        else:
            manifest = workdir / "laya.toml"
            manifest.write_text(manifest_text.replace("{port}", str(self.port)))
            command = [str(manifest), *args]
        self.log_path = workdir / "server.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "laya_core.cli.main", "serve", *command],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 120.0, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", headers=headers,
                             timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


SMOLLM_MANIFEST = """
[server]
host = "127.0.0.1"
port = {port}

[[models]]
name = "smollm2"
backend = "llamacpp"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 1024
max_num_seqs = 8
embeddings = true
"""


@contextlib.contextmanager
def serving(manifest_text: str, workdir: Path,
            api_key: str | None = None) -> Iterator[ServerProcess]:
    """A ready ``laya serve`` of ``manifest_text``; stopped afterwards, and it must exit 0.
    ``api_key``: the key its /ready needs, where the manifest sets ``api_keys``."""
    server = ServerProcess(manifest_text, workdir)
    try:
        server.wait_ready(api_key=api_key)
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log()}"


# The backends that serve the embedded model: every test of ``smollm_server`` runs on each.
SMOLLM_BACKENDS = ("llamacpp", "torch")
# What the front end alone decides (HTTP details, the access log, shutdown, the chat-template
# sandbox, routing) is tested on one backend: the backend sits behind the same EngineClient,
# in a worker process, whichever it is. What a backend decides is tested on each: the
# conformance suite, the smollm_server battery, determinism, log-probabilities, metrics.
FRONT_END_BACKENDS = ("llamacpp",)


def smollm_manifest(backend: str) -> str:
    return SMOLLM_MANIFEST.replace('backend = "llamacpp"', f'backend = "{backend}"')


# What makes each backend's greedy output exactly repeatable (docs/architecture.md,
# "Determinism"): a fixed thread count, and llama.cpp's flash attention off, or torch's
# 16-bit and integer kernels (bfloat16 with the file's int4 layers, quantize "auto"), whose
# rows are the same bits in any batch, with attention in float64 (/ready's batch_invariant;
# its float32 kernels are not). One torch thread: two beside a busy process (this one's
# references, other tests) decode four times slower (spec/manifest.md, n_threads). Two
# llama.cpp threads alone, one beside another pytest worker (`make test`'s -n 2): its
# threads spin at each barrier, and two of them on a shared core decode many times slower.
_LLAMACPP_THREADS = 1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2
REPEATABLE_OPTIONS = {"llamacpp": f"flash_attn = false\nn_threads = {_LLAMACPP_THREADS}\n",
                      "torch": 'dtype = "bfloat16"\nn_threads = 1\ndeterministic = true\n'}


def repeatable_manifest(backend: str) -> str:
    """``smollm_manifest(backend)`` with the options for exact repeatability."""
    return smollm_manifest(backend) + "[models.options]\n" + REPEATABLE_OPTIONS[backend]


@contextlib.contextmanager
def repeatable_server(backend: str, workdir: Path) -> Iterator[ServerProcess]:
    """A ready server of ``repeatable_manifest(backend)``, held to its promise: /ready must
    say a sequence's output does not depend on what runs beside it."""
    with serving(repeatable_manifest(backend), workdir) as s:
        s.backend = backend
        assert runtime(s).get("batch_invariant", True), runtime(s)
        yield s


def runtime(server: ServerProcess) -> dict[str, Any]:
    """What the backend of a one-replica server says under /ready's ``runtime``."""
    (replica,) = httpx.get(f"{server.url}/ready").json()["replicas"]
    return dict(replica["runtime"])


@pytest.fixture(scope="session", params=SMOLLM_BACKENDS)
def smollm_server(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real server of the embedded model per backend, for the whole session (pytest
    runs the tests of one backend's server, then stops it and starts the next)."""
    backend = request.param
    with serving(smollm_manifest(backend),
                 tmp_path_factory.mktemp(f"{SESSION_SCRATCH}smollm_server_{backend}")) as server:
        server.backend = backend
        yield server


@pytest.fixture(scope="session")
def q4_0_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded model requantized to Q4_0, a type llama.cpp repacks on x86 and ARM.

    Derived here with llama.cpp's own quantizer (about 0.3 s), so the tests need no download.
    """
    import ctypes

    import llama_cpp

    from laya_core.builtin.model_paths import embedded_file

    out = tmp_path_factory.mktemp(f"{SESSION_SCRATCH}models") / "smollm2-135m-instruct.q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True  # the source is Q4_1 already
    rc = llama_cpp.llama_model_quantize(embedded_file("smollm2-135m-instruct").encode(),
                                        str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize returned {rc}"
    return str(out)


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Pids the test stops; each gets a SIGCONT afterwards, in case it still lives."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
