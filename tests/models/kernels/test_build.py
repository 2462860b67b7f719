"""A failed kernel build must not pass as "kernels unavailable here": the kernel tests skip when `packed.library()` is
None, which is also what a broken build returns. On a CPU whose flags say the kernels run, the library must load
(ADAFLASH_ALLOW_NO_KERNELS=1 allows the skip explicitly), and the int8 path it reports must be the flags' own."""

from __future__ import annotations

import os

import pytest

from adaflash.models.device.cpu import cpu_flags
from adaflash.models.kernels import packed


def test_the_kernels_build_where_the_cpu_can_run_them():
    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("the CPU lacks AVX2 / FMA / F16C: the kernels are rightly unavailable")
    if os.environ.get("ADAFLASH_KERNELS") == "stock" or os.environ.get("ADAFLASH_ALLOW_NO_KERNELS") == "1":
        pytest.skip("the kernels are switched off on purpose")
    assert packed.library() is not None, "the CPU runs our kernels but the library did not build or load (see log)"


def test_the_int8_path_is_the_one_the_cpu_flags_name():
    if packed.library() is None:
        pytest.skip("no library (the test above says whether that is a failure)")
    flags = cpu_flags()
    vnni = {"avx512_vnni", "avx512vl", "avx512bw"} <= flags
    assert packed.int8_isa_supported() == ("amx" if vnni and {"amx_tile", "amx_int8"} <= flags
                                           else "avx512-vnni" if vnni else "avx2")
    if os.environ.get("ADAFLASH_INT8_AMX") != "1":  # AMX only where asked
        assert packed.int8_isa() == ("avx512-vnni" if vnni else "avx2")
