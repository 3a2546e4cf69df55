"""Checksum manifests: a digest of every file a completed output folder holds, checked on load.

``DIR/manifest.json`` (an iteration folder ``iter_N/``, a converted HF folder, an exported adapter)::

    {"format": "glm5-mcore-manifest-1", "algorithm": "xxh3_128",
     "files": {"model/__0_0.distcp": {"size": 123, "digest": "9f..."}, ...}}

lists every file under ``DIR`` (walked, so new kinds of files are covered without changes here)
except the manifest itself and the output marker. It is written once the folder is complete and
before it becomes visible (renamed into place, ``latest`` moved). A load verifies the files it
reads (``verify_under``: the manifest of the nearest enclosing folder, the entries under the path
being read); ``glm5 checkpoint verify DIR`` verifies whole folders.

The hash is xxh3-128 (``xxhash``, ~8 GB/s per core, streamed in 16 MiB blocks; files hashed in
parallel threads, the hash releases the GIL). ``GLM5_VERIFY_CHECKSUMS=0`` (CLI ``--no-verify``) skips
verification on load; manifests are still written. A folder without a manifest (written before
manifests existed) loads unverified. Files the converters stream out (``direct_io.DirectWriter``)
are hashed as they are written (``remember_digest``), so their manifest does not read them back.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Optional

NAME = "manifest.json"
FORMAT = "glm5-mcore-manifest-1"
ALGORITHM = "xxh3_128"
_SKIP = {NAME, ".glm5-output"}
_BLOCK = 16 << 20


class ChecksumError(ValueError):
    """A file does not match its manifest entry (or is missing); the message names the file."""


def verification_enabled() -> bool:
    return os.environ.get("GLM5_VERIFY_CHECKSUMS", "1").lower() not in ("0", "false", "no", "off")


def file_digest(path: str | Path) -> str:
    """xxh3-128 of a file's bytes, streamed in 16 MiB blocks."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


_KNOWN: dict[tuple, str] = {}  # (st_dev, st_ino, size, mtime_ns) -> digest of a file this process wrote


def _key(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def remember_digest(fd: int, digest: str) -> None:
    """Record the digest of a file just written through ``fd`` (valid while it stays unmodified)."""
    _KNOWN[_key(os.fstat(fd))] = digest


def remember_file_digest(path: str | Path, digest: str) -> None:
    """Record ``digest`` as that of the file at ``path`` (a hard link to a verified file: same bytes)."""
    _KNOWN[_key(Path(path).stat())] = digest


def _files(root: Path) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel not in _SKIP:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _digests(root: Path, rels: list[str], threads: int) -> dict[str, str]:
    with ThreadPoolExecutor(max(1, min(threads, len(rels) or 1))) as pool:
        return dict(zip(rels, pool.map(lambda r: file_digest(root / r), rels)))


def _written_digests(root: Path, rels: list[str], threads: int) -> dict[str, str]:
    """Digests for a new manifest: remembered from the write where this process streamed the file,
    hashed from disk otherwise."""
    known = {r: _KNOWN.get(_key((root / r).stat())) for r in rels}
    out = _digests(root, [r for r in rels if known[r] is None], threads)
    out.update({r: d for r, d in known.items() if d is not None})
    return out


def write_manifest(root: str | Path, threads: int = 4) -> Path:
    """Digest every file under ``root`` into ``root/manifest.json`` (call when the folder is complete)."""
    root = Path(root)
    rels = _files(root)
    digests = _written_digests(root, rels, threads)
    files = {r: {"size": (root / r).stat().st_size, "digest": digests[r]} for r in rels}
    tmp = root / f".{NAME}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": files}, indent=1))
    os.replace(tmp, root / NAME)
    return root / NAME


def read_manifest(root: str | Path) -> Optional[dict]:
    """The manifest of ``root`` (None if it has none); a damaged manifest is an error naming it."""
    path = Path(root) / NAME
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChecksumError(f"{path}: damaged manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
        raise ChecksumError(f"{path}: not a {FORMAT} manifest")
    if m.get("algorithm") != ALGORITHM:
        raise ChecksumError(f"{path}: unknown checksum algorithm {m.get('algorithm')!r}")
    return m


def verify(root: str | Path, only: Optional[Iterable[str]] = None, strict: bool = False,
           threads: int = 4) -> int:
    """Check ``root``'s files against its manifest: all of them, or those at/under the relative
    paths ``only``. ``strict`` also refuses files the manifest does not list. Returns the number of
    files checked; raises ``ChecksumError`` naming the first bad file (missing, size, digest)."""
    root = Path(root)
    m = read_manifest(root)
    if m is None:
        raise ChecksumError(f"{root / NAME}: missing; nothing to verify against")
    prefixes = None if only is None else [p.strip("/") for p in only]

    def wanted(rel: str) -> bool:
        return prefixes is None or any(p in ("", ".") or rel == p or rel.startswith(p + "/") for p in prefixes)

    entries = {r: e for r, e in m["files"].items() if wanted(r)}
    for rel, e in entries.items():
        p = root / rel
        if not p.is_file():
            raise ChecksumError(f"{p}: missing (listed in {root / NAME})")
        size = p.stat().st_size
        if size != e["size"]:
            raise ChecksumError(f"{p}: {size} bytes, the manifest says {e['size']} (truncated or replaced)")
    if strict:
        extra = [r for r in _files(root) if wanted(r) and r not in m["files"]]
        if extra:
            raise ChecksumError(f"{root / extra[0]}: not listed in {root / NAME} ({len(extra)} such file(s))")
    digests = _digests(root, sorted(entries), threads)
    for rel in sorted(entries):
        if digests[rel] != entries[rel]["digest"]:
            raise ChecksumError(f"{root / rel}: checksum mismatch (the file is corrupt; {root / NAME} "
                                f"has {entries[rel]['digest']}, the file hashes to {digests[rel]})")
    return len(entries)


def verify_under(path: str | Path, levels: int = 3) -> int:
    """Verify the files at/under ``path`` against the manifest of the nearest enclosing folder
    (``path`` itself or up to ``levels`` parents). No manifest, or verification switched off: 0."""
    if not verification_enabled():
        return 0
    path = Path(path).absolute()
    for root in [path, *list(path.parents)[:levels]]:
        if (root / NAME).is_file():
            return verify(root, [os.path.relpath(path, root).replace(os.sep, "/")])
    return 0


class Background:
    """``verify_under(path)`` on a thread (overlapping a conversion's own reads and compute);
    ``result()`` re-raises its error. Nothing built from the files may be published before it."""

    def __init__(self, path: str | Path):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="glm5-verify")
        self._future = self._pool.submit(verify_under, path)

    def result(self) -> int:
        try:
            return self._future.result()
        finally:
            self._pool.shutdown(wait=True)


def verify_tree(path: str | Path) -> list[tuple[Path, int]]:
    """``glm5 checkpoint verify``: every manifest folder at ``path`` (the folder itself, or each
    ``iter_N`` of a checkpoint folder), strictly. Returns [(folder, files checked)]."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a folder")
    roots = [path] if (path / NAME).is_file() else []
    roots += sorted(p for p in path.glob("iter_*") if p.is_dir() and p.name[5:].isdigit())
    if not roots:
        raise ChecksumError(f"{path}: no {NAME} here or in any iter_* folder; nothing to verify")
    out = []
    for r in roots:
        out.append((r, verify(r, strict=True)))
    return out
