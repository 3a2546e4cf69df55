"""One indexed dataset on disk: Megatron-Core's ``IndexedDataset`` (``PREFIX.bin`` / ``PREFIX.idx``) and,
for a ``glm5 data preprocess`` folder (prefix ``DIR/tokens``), its ``DIR/loss_mask`` stream and
``DIR/summary.json``. Opening checks, in O(1), that the files belong together: the ``.bin`` is the size
its ``.idx`` indexes, the loss-mask stream is whole and matches the tokens, a mask the summary records
is there; a document's token ids are checked against the model's vocabulary as it is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from glm5_mcore.data.sft import Document

TOKENS, MASK = "tokens", "loss_mask"  # the names glm5_mcore.data.preprocess writes


def open_indexed(prefix: str):
    """Megatron's ``IndexedDataset`` of ``prefix`` (memory-mapped; the .bin mapping is only touched
    with mmap), refused naming the file when ``.bin`` is not the size its ``.idx`` describes (a
    ``.bin`` from another dataset, or cut short) or the pair does not open."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for f in (idx, bin_):
        if not f.is_file():
            other = bin_ if f == idx else idx
            raise FileNotFoundError(f"{f}: missing beside {other}" if other.is_file() else f"{f}: missing")
    try:
        ds = IndexedDataset(prefix, mmap=bin_.stat().st_size > 0)
    except Exception as e:  # noqa: BLE001 - a damaged index: name the file, not Megatron's assert
        raise ValueError(f"{idx}: not a readable Megatron indexed dataset index "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    n, item = len(ds.sequence_lengths), ds.index.dtype_size
    want = int(ds.index.sequence_pointers[-1]) + int(ds.sequence_lengths[-1]) * item if n else 0  # O(1)
    have = bin_.stat().st_size
    if have != want:
        raise ValueError(f"{bin_}: {have} bytes, but {idx} indexes {want} ({n} sequences of {item}-byte "
                         f"tokens): the two files are not one dataset ({'cut short' if have < want else 'another dataset'}"
                         "?); re-run glm5 data preprocess")
    return ds


def preprocess_summary(prefix: str) -> Optional[dict]:
    """``summary.json`` of the ``glm5 data preprocess`` folder ``prefix`` belongs to (None: another tool's)."""
    path = Path(prefix).with_name("summary.json")
    if Path(prefix).name != TOKENS or not path.is_file():
        return None
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    return out if isinstance(out, dict) else None


class Corpus:
    """One indexed dataset (Megatron's ``IndexedDataset``, memory-mapped) + its optional loss-mask
    stream; one sequence per document. ``vocab_size`` > 0: a document holding a token id beyond it is
    an error naming the dataset and the document (the model's embedding would fail on it)."""

    def __init__(self, prefix: str, mmap: bool = True, vocab_size: int = 0):
        self.prefix, self.mmap, self._fds, self.vocab_size = prefix, mmap, {}, vocab_size
        self.tokens = open_indexed(prefix)
        mask = str(Path(prefix).with_name(MASK)) if Path(prefix).name == TOKENS else None
        self.mask = None
        if mask and (Path(mask + ".idx").exists() or Path(mask + ".bin").exists()):
            self.mask = open_indexed(mask)
        elif mask and (preprocess_summary(prefix) or {}).get("loss_mask"):
            raise FileNotFoundError(f"{mask}.idx: missing, and {Path(prefix).with_name('summary.json')} records a "
                                    "loss mask: without it the prompt tokens would be trained; restore it or "
                                    "re-run glm5 data preprocess")
        n = len(self.tokens.document_indices) - 1
        if len(self.tokens) != n:
            raise ValueError(f"{prefix}: {len(self.tokens)} sequences in {n} documents; one sequence per "
                             "document expected (preprocess without sentence splitting)")
        item = self.tokens.index.dtype_size
        if self.mask is not None and (len(self.mask) != n or  # O(1): no pass over the index
                                      os.path.getsize(mask + ".bin") * item != os.path.getsize(prefix + ".bin")):
            raise ValueError(f"{mask}: the loss-mask stream does not match {prefix} (documents or tokens differ)")

    def __len__(self) -> int:
        return len(self.tokens)

    def _get(self, ds, doc: int, n: int) -> np.ndarray:
        """The first ``n`` items of sequence ``doc``: from the mapping, or one pread of a kept-open file
        (Megatron's own file reader opens the file for every read)."""
        if self.mmap:
            return ds.get(doc, 0, n)
        if ds.path_prefix not in self._fds:
            self._fds[ds.path_prefix] = os.open(ds.path_prefix + ".bin", os.O_RDONLY)
        size = ds.index.dtype_size
        raw = os.pread(self._fds[ds.path_prefix], n * size, int(ds.index.sequence_pointers[doc]))
        return np.frombuffer(raw, dtype=ds.index.dtype)

    def document(self, doc: int, max_tokens: int) -> Document:
        n = min(int(self.tokens.sequence_lengths[doc]), max_tokens + 1)
        raw = self._get(self.tokens, doc, n)
        if self.vocab_size and n and int(raw.max()) >= self.vocab_size:
            raise ValueError(f"{self.prefix}: document {doc} holds token id {int(raw.max())}, beyond the model's "
                             f"vocabulary of {self.vocab_size} (tokenized for another model?)")
        toks = raw.tolist()
        mask = self._get(self.mask, doc, n).tolist() if self.mask is not None else [1] * n
        return Document(toks, mask, f"{self.prefix}#{doc}")

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
