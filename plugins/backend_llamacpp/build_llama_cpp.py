"""Builds llama-cpp-python, at the version the llama.cpp backend pins, from its sources with
Laya's patches to llama.cpp applied (``patches/*.patch`` beside this file), and prints the
wheel's path (or writes it to ``--out``). The Makefile's install step installs that wheel,
and shows the compile's progress from this program's output.

    python plugins/backend_llamacpp/build_llama_cpp.py [--out FILE] [--cache DIR]

The patches:

- ``q4_1-gemm.patch``: a kernel for products of a Q4_1 matrix with two or more rows of
  activations on x86 CPUs with AVX2. llama.cpp has none (it multiplies such a matrix by one
  row at a time), and Q4_1 is the embedded model's type: prompts, several sequences decoding
  together and a draft's check all paid nearly one pass over the weights per row. With
  AVX-512 it takes a row of weights two blocks at a time. And for five to sixteen rows
  (a draft's check, up to sixteen sequences' decodes) both it and llamafile's Q8_0 kernel
  (the embedded model's output matrix) go over the weights once or twice in tiles of two
  weight rows by up to eight activation rows, where llamafile made tiles of four and read
  the whole matrix again for the rows left over. Each row's result is bit for bit what the
  one-row product gives (tests/backend_llamacpp/test_q4_1_gemm.py); docs/benchmarks.md has
  what it changes.
- ``exact-attention-rows.patch``: attention's products with the KV cache (a view, never a
  weight) skip llamafile's tiles and go through ggml's vec_dot one output at a time, as a
  one-row decode's always do. The tiles sum in another order, so a row of a draft's check,
  a prompt chunk or a batch came out up to 0.7 in a logit away from the same row decoded
  alone, and greedy output with drafts could differ from the output without them at a
  near-tie. With it, flash attention off and weight types whose several-row products are
  exact (the embedded model's Q4_1 and Q8_0; ``laya_backend_llamacpp.cpu.batch_invariance``),
  each row is the bits a one-row decode gives (tests/backend_llamacpp/test_exact_rows.py).
- ``f16-dot-rows.patch``: with AVX512, attention's products compute sixteen outputs a call
  (sixteen rows of the KV cache against one query row, the query loaded and converted once),
  each summed with ggml_vec_dot_f16's accumulators and order. The sixteen final reductions
  are done together, the same additions in shuffled lanes, and where several query rows
  read the same sixteen KV rows (a prompt, a draft's check) those rows are converted to
  floats once for all of them: the same bits, fewer instructions. Rows left over go four at
  a time; elsewhere the call is ggml_vec_dot_f16's.
- ``prefetch-weights.patch``: the one-row products of Q4_0, Q4_1 and Q8_0 weights (every
  matrix of a decode at c=1) ask for the weights 8 KB ahead of the block in use, and so do
  the several-row kernels of ``q4_1-gemm.patch`` and llamafile's Q8_0 tiles. On an Intel
  Xeon under KVM the hardware prefetchers left these loops waiting on memory (a 65 MB Q4_1
  matrix times one row read at 13 GB/s, where plain reads reach 57), and a decode of the
  embedded model took 6.5 ms where it now takes 5.0. Prefetching changes no result.
- ``kv-cells-pad.patch``: attention runs over the KV cells in use rounded up to 64, not 256.
  Without flash attention every padded cell is computed and then masked (about 4 us a cell
  a token on the embedded model, 0.8 ms of a 10 ms decode at position 40). 64 is a multiple
  of ggml_vec_dot_f16's step, so the padding never moves a cell into its scalar tail and
  rows stay exact (32 broke that; test_exact_rows.py has the case).

The wheel is kept in DIR (default ``~/.cache/laya/llama-cpp-python``) under a key of what
decides its contents: the version, the patches, ``CMAKE_ARGS`` (``make install GPU=cuda``
sets it), the Python, and the CPU's flags, since the build compiles for the CPU it runs on
and its wheel would stop with an illegal instruction on a CPU that lacks one of them. Its
version carries the local label ``+laya.q41gemm.rowexact`` (``pip show llama-cpp-python`` tells
which build is installed; ``==0.3.36`` still matches it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATCHES = sorted((HERE / "patches").glob("*.patch"))
LABEL = "laya.q41gemm.rowexact"


def pinned_version() -> str:
    project = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name, _, version = requirement.partition("==")
        if name.strip() == "llama-cpp-python" and version:
            return version.strip()
    raise SystemExit("plugins/backend_llamacpp/pyproject.toml: no llama-cpp-python==VERSION")


def cpu_flags() -> str:
    # Not laya_backend_llamacpp.cpu.read_cpuinfo: this runs before Laya is installed.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def cache_key(version: str) -> str:
    h = hashlib.sha256()
    for part in (version, LABEL, os.environ.get("CMAKE_ARGS", ""), sys.version,
                 platform.machine(), cpu_flags()):
        h.update(part.encode() + b"\0")
    for patch in PATCHES:
        h.update(patch.name.encode() + b"\0" + patch.read_bytes())
    return h.hexdigest()[:16]


def apply_patch(diff: str, root: Path) -> None:
    """Applies a unified diff (``a/PATH`` and ``b/PATH`` names) to the files under ``root``.
    Each hunk's old lines must stand where its header says (after the hunks before it), else
    ValueError names the file and the hunk. Here rather than patch(1), which a fresh machine
    may lack, or git apply, which inside a git work tree takes paths from that tree's root."""
    hunk_header = re.compile(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@")
    files: dict[Path, list[tuple[int, list[str], list[str], str]]] = {}
    target: Path | None = None
    lines = diff.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("+++ "):
            target = root / line[4:].strip().split("\t")[0].split("/", 1)[1]
            files.setdefault(target, [])
            continue
        m = hunk_header.match(line)
        if m is None or target is None:
            continue
        old: list[str] = []
        new: list[str] = []
        # The header's line counts end the hunk: a next file's "--- a/PATH" is no removal.
        num_old, num_new = int(m.group(2) or 1), int(m.group(3) or 1)
        while i < len(lines) and (len(old) < num_old or len(new) < num_new) and \
                lines[i][:1] in (" ", "-", "+", "\n"):
            kind, body = lines[i][:1], lines[i][1:] if lines[i] != "\n" else "\n"
            if kind in (" ", "-", "\n"):
                old.append(body)
            if kind in (" ", "+", "\n"):
                new.append(body)
            i += 1
        files[target].append((int(m.group(1)), old, new, line.strip()))
    if not files:
        raise ValueError("no file in the diff")
    for path, hunks in files.items():
        text = path.read_text().splitlines(keepends=True)
        offset = 0
        for start, old, new, header in hunks:
            at = start - 1 + offset
            if text[at:at + len(old)] != old:
                raise ValueError(f"{path.relative_to(root)}: hunk {header} does not match")
            text[at:at + len(old)] = new
            offset += len(new) - len(old)
        path.write_text("".join(text))


def run(cmd: list[str]) -> None:
    """``cmd`` with its output on ours (the Makefile logs it and shows the compile's
    progress); exit if it fails."""
    print(f"$ {' '.join(cmd)}", flush=True)
    if subprocess.run(cmd, stderr=subprocess.STDOUT).returncode != 0:
        raise SystemExit(f"laya: pip {cmd[3]} failed; its output is above")


def build(version: str, into: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=into.parent) as scratch:
        work = Path(scratch)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-d", str(work), f"llama-cpp-python=={version}"])
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (src,) = (p for p in work.iterdir() if p.is_dir())
        for patch in PATCHES:
            try:
                apply_patch(patch.read_text(), src)
            except ValueError as e:
                raise SystemExit(f"laya: {patch.name} does not apply to llama-cpp-python "
                                 f"{version}: {e}") from None
        init = src / "llama_cpp" / "__init__.py"
        text, n = re.subn(r'__version__ = "([^"+]+)"', rf'__version__ = "\1+{LABEL}"',
                          init.read_text())
        if n != 1:
            raise SystemExit(f"laya: no __version__ to label in {init}")
        init.write_text(text)
        print(f"laya: compiling llama.cpp (llama-cpp-python {version} with "
              f"{', '.join(p.name for p in PATCHES)}) into {into}", flush=True)
        into.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-cache-dir", "-w",
             str(into), str(src)])
    (wheel,) = into.glob("*.whl")
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the wheel's path here, not on stdout")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "LAYA_WHEEL_CACHE", Path.home() / ".cache" / "laya" / "llama-cpp-python")))
    args = parser.parse_args(argv)
    version = pinned_version()
    into = args.cache / cache_key(version)
    wheels = sorted(into.glob("*.whl"))
    if wheels:
        print(f"laya: llama-cpp-python {version}+{LABEL} from {into}", flush=True)
    else:
        args.cache.mkdir(parents=True, exist_ok=True)
        wheels = [build(version, into)]
    if args.out:
        args.out.write_text(f"{wheels[0]}\n")
    else:
        print(wheels[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
