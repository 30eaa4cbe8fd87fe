"""The CPU facts the llama.cpp backend reads, and the choices it makes from them."""

from __future__ import annotations

from pathlib import Path

from laya_backend_llamacpp import cpu

# /proc/cpuinfo excerpts of the two CPU kinds this project's machines have had.
XEON_SPR = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512_vnni avx512_bf16
"""
AMX_BUILD = ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_BF16 = 1 | "
             "AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
PLAIN_BUILD = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | OPENMP = 1 | REPACK = 1 | "


def test_cpuinfo_names_the_model_and_the_notable_flags() -> None:
    xeon = cpu.read_cpuinfo(XEON_SPR)
    assert xeon.model.startswith("Intel(R) Xeon(R) Platinum")
    assert xeon.notable_flags == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                                  "amx_tile", "amx_int8", "amx_bf16"]
    assert "amx_int8" not in cpu.read_cpuinfo(EPYC).notable_flags
    assert cpu.read_cpuinfo("").model == "unknown CPU"


def test_build_features_are_the_ones_set_to_1() -> None:
    features = cpu.build_features(AMX_BUILD)
    assert {"AVX2", "AMX_INT8", "REPACK", "OPENMP"} <= features
    assert "AMX_INT8" not in cpu.build_features(PLAIN_BUILD)
    assert "AVX512_BF16" not in cpu.build_features("AVX512_BF16 = 0 | AVX2 = 1 |")


def test_auto_turns_repacking_off_only_where_the_amx_buffer_could_be_chosen() -> None:
    xeon, epyc = cpu.read_cpuinfo(XEON_SPR), cpu.read_cpuinfo(EPYC)
    amx, plain = cpu.build_features(AMX_BUILD), cpu.build_features(PLAIN_BUILD)
    choice = cpu.choose_repack("auto", xeon, amx)
    assert choice.enabled is False and "AMX" in choice.reason
    assert cpu.choose_repack("auto", xeon, plain).enabled  # a build without AMX code
    assert cpu.choose_repack("auto", epyc, plain).enabled
    assert cpu.choose_repack("auto", epyc, amx).enabled  # an AMX build on a CPU without it


def test_an_explicit_repack_setting_wins() -> None:
    xeon, amx = cpu.read_cpuinfo(XEON_SPR), cpu.build_features(AMX_BUILD)
    assert cpu.choose_repack(True, xeon, amx).enabled
    assert not cpu.choose_repack(False, cpu.read_cpuinfo(EPYC), amx).enabled


def test_repacked_types_follow_the_instruction_sets() -> None:
    epyc = cpu.repacked_types(cpu.read_cpuinfo(EPYC), cpu.build_features(PLAIN_BUILD))
    assert {"q4_0", "q4_k", "iq4_nl", "q2_k"} <= epyc and "q4_1" not in epyc
    xeon = cpu.repacked_types(cpu.read_cpuinfo(XEON_SPR), cpu.build_features(AMX_BUILD))
    assert {"q4_1", "q8_0", "q6_k"} <= xeon  # the AMX buffer takes these too
    assert cpu.repacked_types(cpu.read_cpuinfo("flags : fpu sse2"), frozenset()) == frozenset()


def test_auto_mmap_reads_the_file_when_its_weights_get_repacked() -> None:
    repacked = frozenset({"q4_0", "q4_k"})
    assert cpu.choose_mmap("auto", True, frozenset({"q4_1", "f32"}), repacked)
    assert not cpu.choose_mmap("auto", True, frozenset({"q4_0", "f32"}), repacked)
    assert cpu.choose_mmap("auto", False, frozenset({"q4_0"}), repacked)  # nothing repacked
    assert cpu.choose_mmap(True, True, frozenset({"q4_0"}), repacked)
    assert not cpu.choose_mmap(False, False, frozenset(), repacked)


def _topology(root: Path, cpu_id: int, package: int, core: int) -> None:
    folder = root / f"devices/system/cpu/cpu{cpu_id}/topology"
    folder.mkdir(parents=True)
    (folder / "physical_package_id").write_text(f"{package}\n")
    (folder / "core_id").write_text(f"{core}\n")


def test_physical_cores_count_hyperthread_pairs_once(tmp_path: Path) -> None:
    for cpu_id, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0)]):
        _topology(tmp_path, cpu_id, package, core)
    assert cpu.physical_cores(range(5), tmp_path) == 3
    assert cpu.physical_cores([0, 2], tmp_path) == 1  # two threads of one core
    assert cpu.physical_cores([0, 1, 7], tmp_path) == 3  # topology unreadable: count CPUs


def test_batch_invariance_needs_flash_attention_off_the_patched_build_and_checked_types() -> None:
    epyc = cpu.read_cpuinfo(EPYC)
    repacked = cpu.repacked_types(epyc, cpu.build_features(PLAIN_BUILD))
    ours, pypi = "0.3.36+laya.q41gemm.rowexact", "0.3.36"
    embedded = frozenset({"q4_1", "q8_0"})  # the layers and the tied head

    def invariant(flash: object = False, version: str = ours, types: frozenset[str] = embedded,
                  on: cpu.CpuInfo = epyc, gpu: int = 0) -> bool:
        return cpu.batch_invariance(flash, version, types, on, repacked, gpu)[0]

    assert invariant()
    assert invariant(types=frozenset({"q8_0"}))
    assert not invariant(types=frozenset({"q6_k", "q8_0"}))  # measured: rows differ
    assert not invariant(flash=True) and not invariant(flash="auto")
    assert not invariant(version=pypi) and not invariant(version="0.3.36+laya.q41gemm")
    assert not invariant(types=frozenset({"f16"}))  # float tiles sum in another order
    assert not invariant(types=frozenset({"q4_0", "q8_0"}))
    assert not invariant(types=frozenset())
    assert not invariant(gpu=10)
    assert not invariant(on=cpu.read_cpuinfo("model name : arm\nFeatures : asimd\n"))
    xeon = cpu.read_cpuinfo(XEON_SPR)  # repack = true there: the AMX buffer takes both
    ok, why = cpu.batch_invariance(False, ours, embedded, xeon,
                                   cpu.repacked_types(xeon, cpu.build_features(AMX_BUILD)), 0)
    assert not ok and "q4_1, q8_0 weights repacked" in why, why
    ok, why = cpu.batch_invariance(False, pypi, embedded, epyc, repacked, 0)
    assert not ok and "make install" in why
