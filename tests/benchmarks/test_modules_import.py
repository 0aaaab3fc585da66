"""Every benchmark module imports (`python -m benchmarks.<group>.<name>` would at least
start): a module moved or renamed under the harness breaks here, not on the machine that
runs it next (a GPU host, an AMX Xeon) where a failed start costs the run."""
from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks

# __main__ modules run their command when imported; gpu_check*.py are scripts run by path
# (`python benchmarks/gpu_check.py`), importing each other flat: the last test starts it.
MODULES = sorted(m.name for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks.")
                 if not m.name.endswith("__main__") and not m.name.startswith("benchmarks.gpu_check"))


@pytest.mark.unit
def test_there_are_benchmark_modules_to_import():
    assert len(MODULES) > 40 and "benchmarks.compare.run" in MODULES and "benchmarks.gpu.at_size" in MODULES


@pytest.mark.unit
@pytest.mark.parametrize("name", MODULES)
def test_imports(name):
    importlib.import_module(name)


@pytest.mark.multiprocess
def test_gpu_check_starts_from_another_folder(tmp_path):
    script = Path(benchmarks.__file__).parent / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--only" in out.stdout
