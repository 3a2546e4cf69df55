"""Write a folder or file so that a reader only ever sees the old or the complete new version.

Everything is written under a temporary sibling and renamed into place when complete; an error
(or Ctrl-C) removes the temporary and leaves any previous output untouched.

A command's ``--out`` goes through ``output_dir`` / ``check_output`` (one guard for every command):
the target may be absent, empty, or a previous output of the same kind of command (it holds the
marker file ``.glm5-output`` that ``output_dir`` writes, ``{"kind": "convert mcore-to-hf"}``);
anything else is refused naming what is there, unless ``overwrite``. A target equal to, inside,
or containing one of the command's inputs is always refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from glm5_mcore.checkpoint.manifest import write_manifest


MARKER = ".glm5-output"


class OutputError(ValueError):
    """``--out`` is refused; the message names the path and what is there."""


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces ``out`` when the block finishes cleanly (the
    previous ``out`` is renamed aside, the new one renamed in, then the old one deleted)."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"{out}: cannot create it ({e.strerror}: {e.filename or out.parent})") from None
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        if out.exists() or out.is_symlink():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def output_kind(path: str | Path) -> str | None:
    """The command kind recorded in ``path/.glm5-output`` (None: no or unreadable marker)."""
    try:
        return json.loads((Path(path) / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def _related(a: Path, b: Path) -> str | None:
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "contains"
    return None


def check_output(out: str | Path, kind: str, inputs: Iterable = (), overwrite: bool = False,
                 what: str = "--out", hint: str = "pass --overwrite to replace it, or choose another folder") -> Path:
    """Refuse ``out`` unless it is absent, an empty folder, or a previous ``kind`` output (or
    ``overwrite``); always refuse it when it is, lies inside or contains an input. Returns ``out``."""
    out = Path(out)
    real = out.resolve()
    for inp in inputs:
        if inp is None or str(inp) == "" or not Path(inp).exists():
            continue
        rel = _related(real, Path(inp).resolve())
        if rel:
            raise OutputError(f"{out}: {what} {rel} the input {inp}; write the output somewhere else")
    if not (out.exists() or out.is_symlink()):
        parent = next((p for p in out.absolute().parents if p.exists()), None)
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(f"{out}: cannot create it, {parent} is not writable")
        return out
    if not os.access(out.absolute().parent, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: cannot replace it, {out.absolute().parent} is not writable")
    if overwrite:
        return out
    if not out.is_dir():  # a link to a folder is judged by the folder (a replacement swaps the link only)
        raise OutputError(f"{out}: {what} names an existing file, not a folder "
                          f"(pass --overwrite to replace it)")
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
    if not entries or output_kind(out) == kind:
        return out
    found = output_kind(out)
    held = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
    why = f"a previous {found!r} output" if found else f"not empty and not a previous {kind!r} output"
    raise OutputError(f"{out}: {what} is {why} (holds {held}); {hint}")


def write_marker(folder: str | Path, kind: str) -> None:
    """Mark ``folder`` as the output of command ``kind`` (what ``check_output`` accepts to replace)."""
    (Path(folder) / MARKER).write_text(json.dumps({"kind": kind}) + "\n")


@contextlib.contextmanager
def output_dir(out: str | Path, kind: str, inputs: Iterable = (), overwrite: bool = False,
               manifest: bool = True) -> Iterator[Path]:
    """``check_output`` then ``atomic_dir``: a command's ``--out`` built aside and renamed into
    place, with its marker and (``manifest``) a checksum manifest of everything in it."""
    check_output(out, kind, inputs, overwrite)
    with atomic_dir(out) as tmp:
        yield tmp
        write_marker(tmp, kind)
        if manifest:
            write_manifest(tmp)


def check_output_file(path: str | Path, kind: str, file_kind, inputs: Iterable = (),
                      overwrite: bool = False, what: str = "--out") -> Path:
    """``check_output`` for a single-file output: its folder must exist; an existing file is
    replaced only when ``file_kind(path)`` (the marker the file format carries) is ``kind``, or with
    ``overwrite``; a folder there is always refused."""
    path = Path(path)
    if not path.absolute().parent.is_dir():
        raise OutputError(f"{path}: {what}: the folder {path.absolute().parent} does not exist")
    if path.is_dir():
        raise OutputError(f"{path}: {what} names a folder, expected a file path")
    for inp in inputs:
        if inp is not None and path.exists() and Path(inp).exists() and path.resolve() == Path(inp).resolve():
            raise OutputError(f"{path}: {what} is the input {inp}; write the output somewhere else")
    if not os.access(path.absolute().parent, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot write it, {path.absolute().parent} is not writable")
    if path.exists() and not overwrite:
        try:
            found = file_kind(path)
        except Exception:  # noqa: BLE001 - any unreadable file is simply not ours
            found = None
        if found != kind:
            raise OutputError(f"{path}: {what} names an existing file that is not a previous {kind!r} output "
                              "(pass --overwrite to replace it)")
    return path


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
