"""Write a folder or file so that a reader only ever sees the old or the complete new version.

Everything is written under a temporary sibling and renamed into place when complete; an error
(or Ctrl-C) removes the temporary and leaves any previous output untouched.

A command's ``--out`` goes through ``output_dir`` / ``check_output`` (one guard for every command):
the target may be absent, empty, or a previous output of the same kind of command (it holds the
marker file ``.glm5-output`` that ``output_dir`` writes, ``{"kind": "convert mcore-to-hf"}``);
anything else is refused naming what is there, unless ``overwrite``. A target equal to, inside,
or containing one of the command's inputs is always refused.

Temporary folders (``.OUT.tmp-*`` beside an output, ``.glm5-export-*`` scratch) come from
``scratch_dir``, which writes an owner file ``.glm5-tmp`` (pid, its start time, host) into each. A
run killed with SIGKILL cannot remove its own; the next ``scratch_dir`` with the same prefix in the
same folder removes every one whose owner file names a process of this host that is gone. A folder
without the owner file, or whose owner is alive or on another host, is never touched.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from glm5_mcore.checkpoint.manifest import write_manifest


MARKER = ".glm5-output"
OWNER = ".glm5-tmp"


class OutputError(ValueError):
    """``--out`` is refused; the message names the path and what is there."""


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (``/proc/PID/stat`` field 22; None where there is no /proc):
    tells a live owner from a later process that reuses its pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(")", 1)[-1].split()[19]


def _owner_gone(folder: Path) -> bool:
    """Whether ``folder``'s owner file names a process of this host that no longer runs."""
    try:
        owner = json.loads((folder / OWNER).read_text())
        pid, host, started = int(owner["pid"]), owner["host"], owner.get("started")
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not ours, or unreadable: never touched
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return started is not None and _start_time(pid) not in (None, started)  # the pid reused since


def remove_stale(parent: str | Path, prefix: str) -> list[Path]:
    """Delete the folders ``parent/prefix*`` that ``scratch_dir`` made for a process that is gone
    (killed runs); returns them."""
    gone = []
    for p in Path(parent).glob(f"{glob.escape(prefix)}*"):
        if p.is_dir() and not p.is_symlink() and _owner_gone(p):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def scratch_dir(parent: str | Path, prefix: str) -> Path:
    """A new empty folder ``parent/prefix<random>`` holding its owner file (this process), after the
    stale ones of killed runs with the same prefix are removed (``remove_stale``)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale(parent, prefix)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    owner = {"pid": os.getpid(), "started": _start_time(os.getpid()), "host": socket.gethostname()}
    (tmp / OWNER).write_text(json.dumps(owner) + "\n")
    return tmp


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces ``out`` when the block finishes cleanly (the
    previous ``out`` is renamed aside, the new one renamed in, then the old one deleted). The
    temporary is a ``scratch_dir`` (its owner file is removed before the rename): one left by a
    killed run is removed by the next run writing the same ``out``."""
    out = Path(out)
    try:
        tmp = scratch_dir(out.parent, f".{out.name}.tmp-")
    except OSError as e:
        raise OutputError(f"{out}: cannot create it ({e.strerror}: {e.filename or out.parent})") from None
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        (tmp / OWNER).unlink(missing_ok=True)
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
