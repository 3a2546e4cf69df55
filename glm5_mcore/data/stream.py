"""One SFT run's data, step by step: the micro-batches this rank trains on and validates with, from a
jsonl file (documents read once, packed per epoch in ``data.order.epoch_order``) or from Megatron indexed
datasets (``data.indexed.IndexedData``, samples read lazily), with one padding rule for both.

The padding rule (``SFTStream.prepare``): under pipeline parallelism every pack is padded to the one fixed
shape ``[micro_batch_tokens, 1, H]`` the stages exchange (the allgather dispatcher rules out Megatron's
``variable_seq_lengths``); else, with EP and Megatron's allgather token dispatcher (the CPU one), micro-batch
i of every rank is padded to the largest micro-batch i over all ranks (a masked filler document); then each
pack is cut to this CP rank's share.

``data`` is an SFT ``data`` section (``recipes.sft_config.DataCfg``); the step position lives in the run's
``state`` (``epoch``, ``cursor`` for jsonl; ``sample``, the next indexed sample), which the checkpoint saves.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from glm5_mcore.data.indexed import IndexedData, is_jsonl
from glm5_mcore.data.order import epoch_order, equal_micro_batch_sizes
from glm5_mcore.data.sft import DataStats, Document, PackedBatch, pack, pad_to, read_jsonl, split_for_cp


def is_indexed(data) -> bool:
    """Whether the run reads Megatron indexed datasets (``data.blend``, or a ``data.train`` that is no jsonl)."""
    return bool(data.blend) or not is_jsonl(data.train)


class SFTDocuments:
    """The jsonl documents of a run (tokenised, cut to ``data.max_tokens``); none for indexed data. A
    truncation is reported once on stderr by the reporting rank (``report``)."""

    def __init__(self, data, tokenizer, report: bool = True):
        self.stats, self.val_stats = DataStats(), DataStats()
        self.train: Optional[list[Document]] = None
        self.valid: Optional[list[Document]] = None
        if not is_indexed(data):
            self.train = read_jsonl(data.train, tokenizer, data.max_tokens, data.skip_bad_rows, self.stats)
            if data.valid:
                self.valid = read_jsonl(data.valid, tokenizer, data.max_tokens, data.skip_bad_rows, self.val_stats)
        if (self.stats.truncated or self.val_stats.truncated) and report:
            print(f"sft: {self.stats.truncated} training and {self.val_stats.truncated} validation row(s) longer "
                  f"than data.max_tokens={data.max_tokens} were cut to it (their last tokens not trained), "
                  f"first: {(self.stats.truncated_rows or self.val_stats.truncated_rows)[0]}", file=sys.stderr)


def equalize(batches: list[PackedBatch], pad_id: int) -> list[PackedBatch]:
    """Pad micro-batch i of every rank to the largest micro-batch i over all ranks (and equal counts)."""
    sizes = equal_micro_batch_sizes([b.num_tokens for b in batches])
    if len(sizes) != len(batches):
        raise RuntimeError("ranks disagree on the number of micro-batches per step")
    return [pad_to(b, n, pad_id) for b, n in zip(batches, sizes)]


class SFTStream:
    """This rank's micro-batches of each step (``step``) and of validation (``valid``).

    ``accum`` micro-batches per rank and step, ``dp`` / ``dp_rank`` and ``cp`` / ``cp_rank`` this rank's place,
    ``multiple`` the token multiple of a pack (TP under sequence parallelism), ``equal_sizes``: EP with the
    allgather dispatcher, ``pipeline``: PP > 1 (fixed pack shape). ``state`` is the run's (resumed) state."""

    def __init__(self, data, docs: SFTDocuments, state: dict, *, steps: int, accum: int, dp: int, dp_rank: int,
                 cp: int, cp_rank: int, multiple: int, pad_id: int, equal_sizes: bool, pipeline: bool,
                 cache_dir: str | Path):
        self.data, self.docs = data, docs
        self.accum, self.dp, self.dp_rank, self.cp, self.cp_rank = accum, dp, dp_rank, cp, cp_rank
        self.multiple, self.pad_id, self.equal_sizes = multiple, pad_id, equal_sizes
        self.fixed_tokens = (-(-data.micro_batch_tokens // multiple) * multiple) if pipeline else 0
        self.indexed = docs.train is None
        if self.indexed:  # samples read lazily by index; state["sample"] is the next one
            self.source = IndexedData(data, steps, accum, dp, dp_rank, multiple, pad_id, str(cache_dir),
                                      state.setdefault("sample", 0))
            self.val_mine = self.source.valid_batches()
        else:
            self.packs = self._epoch(state["epoch"])
            if len(self.packs) < accum * dp:
                raise ValueError(f"data.train: one epoch packs into {len(self.packs)} micro-batches, a step needs "
                                 f"{accum * dp} (lower data.global_batch_tokens)")
            val_packs = pack(docs.valid, data.micro_batch_tokens, multiple, pad_id) if docs.valid else []
            self.val_mine = val_packs[dp_rank::dp] or val_packs[:1]

    def _epoch(self, epoch: int) -> list[PackedBatch]:
        train = self.docs.train
        return pack([train[i] for i in epoch_order(len(train), self.data.seed, epoch)], self.data.micro_batch_tokens,
                    self.multiple, self.pad_id)

    def prepare(self, mine: list[PackedBatch]) -> list[PackedBatch]:
        """The padding rule (module docstring), then this CP rank's share of each pack."""
        if self.fixed_tokens:
            mine = [pad_to(b, self.fixed_tokens, self.pad_id) for b in mine]
        elif self.equal_sizes:
            mine = equalize(mine, self.pad_id)
        return [split_for_cp(b, self.cp, self.cp_rank, self.pad_id, self.multiple) for b in mine]

    def step(self, state: dict) -> tuple[list[PackedBatch], int, dict]:
        """(this rank's micro-batches, tokens of the whole step over DP, the state after the step) of the
        step at ``state``; a jsonl run that used up its epoch starts the next one (``state`` updated)."""
        if self.indexed:
            mine, tokens, next_sample = self.source.step(state["sample"])
            return self.prepare(mine), tokens, {"cursor": state["cursor"], "sample": next_sample}
        n = self.accum * self.dp
        if state["cursor"] + n > len(self.packs):
            state["epoch"] += 1
            state["cursor"] = 0
            self.packs = self._epoch(state["epoch"])
        step_batches = self.packs[state["cursor"]: state["cursor"] + n]
        mine = step_batches[self.dp_rank * self.accum: (self.dp_rank + 1) * self.accum]
        tokens = sum(b.num_tokens for b in step_batches)
        return self.prepare(mine), tokens, {"cursor": state["cursor"] + n, "sample": state.get("sample", 0)}

    def valid(self) -> list[PackedBatch]:
        """This rank's validation micro-batches (empty: no validation data)."""
        return self.prepare(self.val_mine)
