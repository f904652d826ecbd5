"""What SGLang's CPU kernel is compiled for: SGLang's own target where the CPU runs it, else
x86-64-v3 (AVX2), and a cached build for the other target built again."""
from __future__ import annotations

import json

import pytest
import setup_cpu_sglang

from rooflib.core.errors import ServerError

V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
AMX = {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}

# The shape of the option block in SGLang's csrc/cpu/CMakeLists.txt (2026-08): one option a line.
OPTIONS = """if(MY_ARCH_DIR STREQUAL "x86_64")
    add_compile_options(
        -O3
        -march=x86-64-v4
        -mavx512bf16
        -mavx512vnni
        -mamx-tile
        -mamx-bf16
        -mamx-int8
        -fopenmp
    )
endif()
"""


@pytest.mark.parametrize("flags, march", [
    (V3 | AVX512 | AMX, "x86-64-v4"),      # a Xeon with AMX (Sapphire Rapids and later)
    (V3 | AVX512 | {"avx512_bf16", "avx512_vnni"}, "x86-64-v3"),  # AVX-512 without AMX (AMD Zen 4)
    (V3 | AVX512, "x86-64-v3"),            # AVX-512 without BF16 (Skylake-SP)
    (V3, "x86-64-v3"),                     # AVX2 only (AMD EPYC before Zen 4)
])
def test_the_kernel_is_built_for_what_the_cpu_runs(flags, march):
    assert setup_cpu_sglang.kernel_march(flags) == march


def test_lowering_keeps_every_other_option_and_drops_the_avx512_and_amx_ones():
    lowered = setup_cpu_sglang.lower_march(OPTIONS)
    assert lowered == OPTIONS.replace("x86-64-v4", "x86-64-v3").replace(
        "        -mavx512bf16\n        -mavx512vnni\n        -mamx-tile\n        -mamx-bf16\n        -mamx-int8\n", "")


def test_a_build_file_without_sglangs_target_is_refused_with_what_to_do():
    with pytest.raises(ServerError, match="no -march=x86-64-v4 to lower: use an SGLang source tree of 2026"):
        setup_cpu_sglang.lower_march(OPTIONS.replace("x86-64-v4", "native"))


@pytest.mark.parametrize("recorded, flags, built_again", [
    ({}, V3 | AVX512 | AMX, False),                              # a record from before targets: SGLang's own
    ({}, V3, True),                                              # ... which a CPU without AVX-512 cannot import
    ({"kernel_march": "x86-64-v3"}, V3, False),
    ({"kernel_march": "x86-64-v3"}, V3 | AVX512 | AMX, True),    # AMX machines call the kernel: their target
])
def test_a_cached_engine_is_built_again_only_for_another_target(recorded, flags, built_again, tmp_path, monkeypatch):
    monkeypatch.setenv("ROOFLINE_CACHE_DIR", str(tmp_path))
    setup_cpu_sglang.venv_dir().mkdir()
    (setup_cpu_sglang.venv_dir() / ".roofline-ready").write_text(json.dumps({"sglang": "0.5.23", **recorded}))
    monkeypatch.setattr(setup_cpu_sglang, "cpu_flags", lambda: flags)
    monkeypatch.setattr(setup_cpu_sglang, "check_machine", lambda source: None)
    monkeypatch.setattr(setup_cpu_sglang, "build", lambda source, from_source, march: {"kernel_march": march})
    record, built_now = setup_cpu_sglang.ensure_engine("src", from_source=False, rebuild=False)
    assert built_now == built_again
    assert record.get("kernel_march", "x86-64-v4") == setup_cpu_sglang.kernel_march(flags)


def test_a_cpu_without_avx2_is_told_what_the_kernel_needs(monkeypatch):
    monkeypatch.setattr(setup_cpu_sglang, "cpu_flags", lambda: V3 - {"avx2", "fma"})
    with pytest.raises(ServerError, match="this CPU lacks avx2, fma: SGLang's CPU kernel is built for x86-64-v3"):
        setup_cpu_sglang.check_machine("src")
