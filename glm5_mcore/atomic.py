"""Write a folder or file so that a reader only ever sees the old or the complete new version.

Everything is written under a temporary sibling and renamed into place when complete; an error
(or Ctrl-C) removes the temporary and leaves any previous output untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces ``out`` when the block finishes cleanly."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_file(path: str | Path) -> None:
    """Give a file written through a private temporary the usual umask permissions."""
    os.chmod(path, 0o666 & ~_umask())


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace a small text file in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
