"""Writing a file whole: under a temporary name beside it, then renamed over it (atomic on
one file system), so that a reader, another process included, sees the old file or the new
one, never a part. The compile cache's executables, the grammar trie's arrays and the
models' SHA-256 markers are written this way."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_whole(path: Path, blob: bytes) -> None:
    """blob at path, whole; its folder made if need be. OSError when it cannot be written
    (the temporary file removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
