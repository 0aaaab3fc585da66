"""kernels/atomic_file.replaced: the target is replaced whole on success and untouched on
failure, with nothing left beside it either way."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.kernels.atomic_file import replaced


def test_written_whole_with_the_mode_and_no_temp_left(tmp_path: Path) -> None:
    target = tmp_path / "cache.json"
    target.write_text("old")
    with replaced(target) as tmp:
        assert Path(tmp).parent == tmp_path and Path(tmp) != target
        Path(tmp).write_text("new")
        assert target.read_text() == "old"  # not replaced before the block ends
    assert target.read_text() == "new"
    assert os.stat(target).st_mode & 0o777 == 0o644
    with replaced(target, mode=0o755) as tmp:
        Path(tmp).write_text("lib")
    assert os.stat(target).st_mode & 0o777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]


def test_a_failed_write_leaves_the_target_as_it_was_and_nothing_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "cache.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="half"):
        with replaced(target) as tmp:
            Path(tmp).write_text("half")
            raise RuntimeError("half written")
    assert target.read_text() == "old"
    with pytest.raises(ValueError):
        with replaced(tmp_path / "new.json") as tmp:
            raise ValueError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]


def test_an_unwritable_folder_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        with replaced(tmp_path / "missing" / "cache.json"):
            pass
