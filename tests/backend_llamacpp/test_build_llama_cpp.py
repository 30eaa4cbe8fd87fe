"""plugins/backend_llamacpp/build_llama_cpp.py: its patches apply to the pinned sources'
lines and nowhere else, and its wheel cache tells builds apart by what decides them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "plugins" / "backend_llamacpp" / "build_llama_cpp.py"
spec = importlib.util.spec_from_file_location("build_llama_cpp", SCRIPT)
assert spec is not None and spec.loader is not None
build = importlib.util.module_from_spec(spec)
sys.modules["build_llama_cpp"] = build
spec.loader.exec_module(build)

DIFF = """--- a/src/f.c
+++ b/src/f.c
@@ -2,3 +2,4 @@
 b
 c
+new
 d
@@ -7,3 +8,3 @@
 b
-c
+C
 d
"""


def test_hunks_apply_where_their_headers_say(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    f = tmp_path / "src" / "f.c"
    f.write_text("a\nb\nc\nd\na\na\nb\nc\nd\n")  # "b c d" twice: only the lines say which
    build.apply_patch(DIFF, tmp_path)
    assert f.read_text() == "a\nb\nc\nnew\nd\na\na\nb\nC\nd\n"
    with pytest.raises(ValueError, match=r"src/f.c: hunk @@ -2,3 \+2,4 @@ does not match"):
        build.apply_patch(DIFF, tmp_path)  # applied already


def test_a_diff_of_two_files_ends_each_hunk_at_its_counted_lines(tmp_path: Path) -> None:
    """A hunk followed by the next file's ``--- a/PATH`` header: that line is no removal."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.c").write_text("a\nb\nc\nd\n")
    (tmp_path / "src" / "g.h").write_text("x\ny\n")
    diff = ("--- a/src/f.c\n+++ b/src/f.c\n@@ -2,2 +2,3 @@\n b\n+new\n c\n"
            "--- a/src/g.h\n+++ b/src/g.h\n@@ -1,2 +1,2 @@\n-x\n+X\n y\n")
    build.apply_patch(diff, tmp_path)
    assert (tmp_path / "src" / "f.c").read_text() == "a\nb\nnew\nc\nd\n"
    assert (tmp_path / "src" / "g.h").read_text() == "X\ny\n"


def test_the_patches_name_the_file_they_change() -> None:
    files = {p.name: p.read_text() for p in build.PATCHES}
    assert sorted(files) == ["exact-attention-rows.patch", "f16-dot-rows.patch",
                             "kv-cells-pad.patch", "prefetch-weights.patch",
                             "q4_1-gemm.patch"]
    for name in ("ggml-cpu.c", "vec.h", "vec.cpp"):
        assert f"+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/{name}" in files["f16-dot-rows.patch"]
    assert "+++ b/vendor/llama.cpp/src/llama-kv-cache.cpp" in files["kv-cells-pad.patch"]
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c" in \
        files["prefetch-weights.patch"]
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp" in files["q4_1-gemm.patch"]
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c" in \
        files["exact-attention-rows.patch"]
    assert build.pinned_version() == "0.3.36"


def test_the_cache_key_follows_the_cpu_and_the_cmake_arguments(monkeypatch) -> None:
    key = build.cache_key("0.3.36")
    assert build.cache_key("0.3.36") == key
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    assert build.cache_key("0.3.36") != key
    monkeypatch.delenv("CMAKE_ARGS")
    monkeypatch.setattr(build, "cpu_flags", lambda: "avx2 fma")
    assert build.cache_key("0.3.36") != key
    assert build.cache_key("0.3.37") != build.cache_key("0.3.36")
