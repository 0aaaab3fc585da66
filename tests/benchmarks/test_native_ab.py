"""benchmarks/cpu_kernels/native_ab.py with this tree as its own baseline: the two builds are one
library, so every case's outputs agree bit for bit and every ratio is reported."""
from __future__ import annotations

from pathlib import Path

from tests.support.bench_scripts import script

native_ab = script("cpu_kernels.native_ab")

ROOT = Path(__file__).resolve().parents[2]


def test_this_tree_against_itself_gives_equal_bits(capsys):
    assert native_ab.main(["--baseline", str(ROOT), "--rows", "3", "--passes", "1", "--dtype", "bfloat16"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "baseline/this" in ln]
    assert len(lines) == 4  # one gemm row count, three attention cases
    assert all(ln.endswith("bits equal: True") for ln in lines)


def test_quantized_kinds_compare_the_int8_dot_products(capsys):
    assert native_ab.main(["--baseline", str(ROOT), "--rows", "1,3", "--passes", "1", "--dtype", "q8_0,q4_1",
                           "--what", "gemm,attention"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "baseline/this" in ln]
    assert [ln.split()[1:3] for ln in lines] == [["q8_0", "1"], ["q8_0", "3"], ["q4_1", "1"], ["q4_1", "3"]]
    assert all(ln.endswith("bits equal: True") for ln in lines)
