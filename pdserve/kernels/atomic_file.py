"""One file written whole or not at all: `with replaced(target) as tmp:` gives a temporary
path beside `target` (same folder, so the rename is atomic); when the block ends without an
error the file is renamed onto `target`, otherwise removed. Readers never see a half-written
file, and several processes (workers loading one model folder, builders of one kernel) may
write the same target at once: the last rename wins with a whole file. Used by the kernel
build, the crossover table, the converted GGUF folder's records and caches, and each worker's
ready file. Not the router process's writes: importing `pdserve.kernels` imports torch, which
the router never loads."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced(target: str | Path, mode: int = 0o644) -> Iterator[str]:
    """A temporary path beside `target` to write; on success it is given `mode` and renamed
    onto `target`; on any error it is removed and the error passes on. Nothing is left behind."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)  # mkstemp's is 0o600: a cache others read needs the usual mode
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
