"""SFT / pretraining data: jsonl rows → token documents with loss masks → THD-packed micro-batches.

Row formats (one JSON object per line):
- ``{"prompt": str, "response": str}``: prompt through the chat template as a user turn (with the
  generation prompt), the response and EOS after it; loss on the response and EOS only.
- ``{"messages": [{"role", "content"}, ...]}``: the tokenizer's chat template; loss on every
  assistant turn (the tokens a turn adds to the conversation), nothing else.
- ``{"text": str}``: pretraining; loss on every token, EOS appended.

A document of tokens t[0..n) trains to predict t[i+1] from t[..i]: inputs t[:-1], labels t[1:],
loss mask = mask of the label token. Packing puts whole documents back to back into micro-batches
of at most ``micro_batch_tokens`` tokens ([1, T] with ``cu_seqlens``; positions restart per
document) — no pad tokens, except when sequence parallelism needs T divisible by TP, which adds one
masked filler document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import torch

from glm5_mcore.data.cp_split import split_for_cp  # noqa: F401  (re-exported: the SFT recipe's CP split)
from glm5_mcore.data.order import greedy_packs
from glm5_mcore.data.jsonl import decode_json_line


@dataclass
class Document:
    tokens: list[int]
    mask: list[int]  # 1 where the token is a training target
    source: str = ""  # "file:line"

    def __len__(self) -> int:
        return len(self.tokens) - 1  # training positions


@dataclass
class DataStats:
    rows: int = 0
    skipped: int = 0
    truncated: int = 0
    """Rows longer than ``max_tokens``, cut to it (they keep some loss tokens)."""
    errors: list[str] = field(default_factory=list)
    truncated_rows: list[str] = field(default_factory=list)
    """``file:line`` of the first truncated rows (at most 20)."""


class DataError(ValueError):
    """A malformed row; the message names the file and line."""


def _ids(enc) -> list[int]:
    return list(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc)


def encode_row(row: dict, tokenizer, where: str) -> Document:
    """One jsonl row as a ``Document``; raises ``DataError`` naming ``where`` on a bad row."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    eos = tokenizer.eos_token_id
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
        tokens, mask = [], []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prefix = _ids(tokenizer.apply_chat_template(msgs[:i], tokenize=True, add_generation_prompt=True))
            full = _ids(tokenizer.apply_chat_template(msgs[: i + 1], tokenize=True))
            if full[: len(prefix)] != prefix:
                raise DataError(f"{where}: the chat template does not extend turn {i}'s prefix")
            mask += [0] * (len(prefix) - len(tokens)) + [1] * (len(full) - len(prefix))
            tokens = full
        if not any(mask):
            raise DataError(f"{where}: no assistant turn to train on")
        full = _ids(tokenizer.apply_chat_template(msgs, tokenize=True))
        mask += [0] * (len(full) - len(tokens))
        tokens = full
        if eos is not None:
            tokens, mask = tokens + [eos], mask + [1 if msgs[-1]["role"] == "assistant" else 0]
        return Document(tokens, mask, where)
    if "prompt" in row or "response" in row:
        p, r = row.get("prompt"), row.get("response")
        if not isinstance(p, str) or not isinstance(r, str) or not r:
            raise DataError(f"{where}: 'prompt' and a non-empty 'response' must be strings")
        prompt = _ids(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                                    add_generation_prompt=True))
        resp = _ids(tokenizer(r, add_special_tokens=False)) + ([eos] if eos is not None else [])
        return Document(prompt + resp, [0] * len(prompt) + [1] * len(resp), where)
    if "text" in row:
        if not isinstance(row["text"], str) or not row["text"]:
            raise DataError(f"{where}: 'text' must be a non-empty string")
        toks = _ids(tokenizer(row["text"], add_special_tokens=False)) + ([eos] if eos is not None else [])
        return Document(toks, [1] * len(toks), where)
    raise DataError(f"{where}: a row needs 'messages', 'prompt'+'response' or 'text' (got keys {sorted(row)})")


def parse_line(line: str | bytes, tokenizer, where: str, max_tokens: Optional[int] = None) -> Document:
    """One jsonl line (bytes: decoded as UTF-8) as a trainable ``Document`` (at least 2 tokens, some
    loss, and with ``max_tokens`` some loss left once cut to it); ``DataError`` naming ``where``
    otherwise. Shared by ``read_jsonl`` and ``glm5 data preprocess``."""
    row = decode_json_line(line, where, DataError)
    doc = encode_row(row, tokenizer, where)
    if len(doc.tokens) < 2 or not any(doc.mask[1:]):
        raise DataError(f"{where}: fewer than 2 tokens or nothing to train on")
    if max_tokens is not None and len(doc.tokens) > max_tokens + 1 and not any(doc.mask[1: max_tokens + 1]):
        raise DataError(f"{where}: {len(doc.tokens) - 1} tokens; cut to data.max_tokens={max_tokens} "
                        "it keeps no loss token (the response would be lost)")
    return doc


def truncate(doc: Document, max_tokens: int) -> tuple[Document, bool]:
    """``doc`` cut to ``max_tokens`` training positions (``max_tokens + 1`` tokens); whether it was cut."""
    if len(doc.tokens) <= max_tokens + 1:
        return doc, False
    return Document(doc.tokens[: max_tokens + 1], doc.mask[: max_tokens + 1], doc.source), True


def read_jsonl(path: str | Path, tokenizer, max_tokens: int, skip_bad_rows: bool = False,
               stats: Optional[DataStats] = None) -> list[Document]:
    """Documents of a jsonl file. Bad rows (invalid JSON or UTF-8, wrong fields, or longer than
    ``max_tokens`` with no loss token left once cut) raise ``DataError`` (file:line), or are skipped
    and counted with ``skip_bad_rows``; other documents longer than ``max_tokens`` are cut to it and
    counted (``stats.truncated``, ``stats.truncated_rows``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: data file does not exist")
    stats = stats if stats is not None else DataStats()
    docs = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{n}"
            stats.rows += 1
            try:
                doc = parse_line(raw, tokenizer, where, max_tokens)
            except DataError as e:
                if not skip_bad_rows:
                    raise
                stats.skipped += 1
                stats.errors.append(str(e))
                continue
            doc, cut = truncate(doc, max_tokens)
            if cut:
                stats.truncated += 1
                if len(stats.truncated_rows) < 20:
                    stats.truncated_rows.append(where)
            docs.append(doc)
    if not docs:
        raise DataError(f"{path}: no usable rows ({stats.skipped} skipped)")
    return docs


@dataclass
class PackedBatch:
    """One THD micro-batch: [1, T] tensors and the document boundaries."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [n_docs + 1]
    sources: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device) -> "PackedBatch":
        """This batch with its tensors on ``device`` (the training device: batches are built on the CPU)."""
        return PackedBatch(self.input_ids.to(device), self.labels.to(device), self.loss_mask.to(device),
                           self.position_ids.to(device), self.cu_seqlens.to(device), self.sources)

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        m = int(lengths.max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=m, max_seqlen_kv=m)


def _batch(docs: list[Document], multiple_of: int = 1, pad_id: int = 0) -> PackedBatch:
    ids, labels, mask, pos, cu, src = [], [], [], [], [0], []
    for d in docs:
        ids += d.tokens[:-1]
        labels += d.tokens[1:]
        mask += d.mask[1:]
        pos += list(range(len(d)))
        cu.append(cu[-1] + len(d))
        src.append(d.source)
    pad = -len(ids) % multiple_of
    if pad:  # sequence parallel needs T % TP == 0: one masked filler document
        ids += [pad_id] * pad
        labels += [pad_id] * pad
        mask += [0] * pad
        pos += list(range(pad))
        cu.append(cu[-1] + pad)
        src.append("<pad>")
    t = lambda x, dt=np.int64: torch.from_numpy(np.fromiter(x, dtype=dt, count=len(x)))[None]  # noqa: E731
    return PackedBatch(t(ids), t(labels), t(mask, np.float32), t(pos), torch.tensor(cu, dtype=torch.int32), src)


def pad_to(batch: PackedBatch, tokens: int, pad_id: int = 0) -> PackedBatch:
    """``batch`` with a masked filler document appended to reach ``tokens`` tokens."""
    pad = tokens - batch.num_tokens
    if pad <= 0:
        return batch
    cat = lambda a, v, dt=torch.long: torch.cat([a, torch.full((1, pad), v, dtype=dt)], 1)  # noqa: E731
    pos = torch.cat([batch.position_ids, torch.arange(pad)[None]], 1)
    cu = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + pad])
    return PackedBatch(cat(batch.input_ids, pad_id), cat(batch.labels, pad_id),
                       cat(batch.loss_mask, 0.0, torch.float32), pos, cu, batch.sources + ["<pad>"])


def pack(docs: list[Document], micro_batch_tokens: int, multiple_of: int = 1, pad_id: int = 0) -> list[PackedBatch]:
    """Greedy in-order packing of whole documents into micro-batches of ≤ ``micro_batch_tokens``."""
    for d in docs:
        if len(d) > micro_batch_tokens:
            raise DataError(f"{d.source}: {len(d)} tokens exceed micro_batch_tokens={micro_batch_tokens}")
    return [_batch([docs[i] for i in g], multiple_of, pad_id)
            for g in greedy_packs((len(d) for d in docs), micro_batch_tokens)]


