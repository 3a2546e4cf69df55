"""Training from Megatron-Core indexed datasets: prefixes, weighted blends, lazy reads, exact resume.

``data.train`` (or ``data.blend``) names indexed datasets instead of a jsonl file: a folder written
by ``glm5 data preprocess`` (prefix ``DIR/tokens`` + its ``DIR/loss_mask`` stream) or any Megatron
prefix (``PATH.bin`` / ``PATH.idx``, e.g. from Megatron-LM's ``preprocess_data.py``; loss on every
token). Megatron-Core's machinery does the bookkeeping:

- ``BlendedMegatronDatasetBuilder`` parses the blend (``[0.7, web, 0.3, code]`` or Megatron's string
  ``"0.7 web 0.3 code"``), cuts each dataset's documents into train/valid/test by ``data.split``
  (``"969,30,1"``) or takes ``data.valid`` as the validation blend (``blend_per_split``), and
  blends with its ``BlendedDataset`` (the compiled ``helpers_cpp.build_blending_indices``: every
  prefix of the stream follows the weights to within one document), indices cached under
  ``train.out/data_cache`` and memory-mapped.
- ``DocumentDataset`` (a ``MegatronDataset``) is one sample per document: training documents in
  ``glm5_mcore.data.order.epoch_order`` (the jsonl path's shuffle), epoch after epoch; validation in order.

The stream of samples 0, 1, 2, ... is packed with the recipe's rule (``glm5_mcore.data.order.greedy_packs``):
a step takes the next accum × DP micro-batches; only document lengths (from the memory-mapped
``.idx``) are needed to plan them, so each DP rank reads the tokens of its own micro-batches only.
The trainer state keeps ``sample``, the next sample index: a resumed run continues at exactly the
next document. The stream's length is estimated from the steps and the mean document length and
grown (rebuilt at twice the size) if packing runs past it; both Megatron index builders depend
only on the weights and the seed, not on the size, so growing never changes the samples already
drawn.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from glm5_mcore.data.corpus import TOKENS, Corpus, preprocess_summary
from glm5_mcore.data.order import epoch_order, greedy_packs
from glm5_mcore.data.preprocess import tokenizer_identity
from glm5_mcore.data.sft import Document, PackedBatch, pack



def is_jsonl(path: Optional[str]) -> bool:
    return bool(path) and str(path).endswith((".jsonl", ".json"))


def resolve_prefix(path: str) -> str:
    """The Megatron prefix of ``path``: a ``glm5 data preprocess`` folder or a ``.bin``/``.idx`` prefix."""
    p = Path(path)
    if p.is_dir() and (p / f"{TOKENS}.idx").is_file():
        p = p / TOKENS
    if not (Path(f"{p}.idx").is_file() and Path(f"{p}.bin").is_file()):
        raise FileNotFoundError(f"{path}: not an indexed dataset (no {p}.idx + {p}.bin, nor a folder "
                                "written by glm5 data preprocess)")
    return str(p)


def parse_blend(blend, field: str = "data.blend") -> tuple[list[str], Optional[list[float]]]:
    """(prefixes, weights or None) of ``[w1, p1, w2, p2, ...]``, ``[p1, p2]`` or Megatron's string
    form ``"w1 p1 w2 p2"``; Megatron-Core's ``get_blend_from_list`` reads the list."""
    from megatron.core.datasets.utils import get_blend_from_list

    items = re.split(r"[\s,]+", blend.strip()) if isinstance(blend, str) else [str(x) for x in blend]
    items = [x for x in items if x]
    if not items:
        raise ValueError(f"{field}: empty blend")
    numbers = [_is_number(x) for x in items]
    if any(numbers):  # weighted: (weight, prefix) pairs, as Megatron's get_blend_from_list reads them
        bad = next((i for i, n in enumerate(numbers) if n != (i % 2 == 0)), None)
        if bad is not None or len(items) % 2:
            where = (f"entry {bad + 1} ({items[bad]!r}) should be a {'weight' if bad % 2 == 0 else 'prefix'}"
                     if bad is not None else f"{len(items)} entries, the last weight has no prefix")
            raise ValueError(f"{field}: {blend!r}: expected weight, prefix pairs ([0.7, web, 0.3, code]) or "
                             f"prefixes alone; {where}")
    try:
        prefixes, weights = get_blend_from_list(items)
    except AssertionError:
        raise ValueError(f"{field}: {blend!r} mixes weighted and unweighted entries") from None
    if weights is not None and any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"{field}: weights must be positive numbers, got {weights}")
    return [resolve_prefix(p) for p in prefixes], weights


def _is_number(x: str) -> bool:
    try:
        float(x)
    except ValueError:
        return False
    return True


def _dataset_classes():
    """``DocumentDataset`` and its config, defined on first use (Megatron-Core imports in seconds)."""
    global _CLASSES
    if "_CLASSES" in globals():
        return _CLASSES
    from dataclasses import dataclass

    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
    from megatron.core.datasets.megatron_dataset import MegatronDataset
    from megatron.core.datasets.utils import Split

    @dataclass
    class DocumentDatasetConfig(BlendedMegatronDatasetConfig):
        max_tokens: int = 1024
        """Training positions per document; longer documents are cut (as the jsonl path does)."""
        vocab_size: int = 0
        """The model's vocabulary: a token id at or beyond it is an error naming the dataset (0: unchecked)."""

    class DocumentDataset(MegatronDataset):
        """Sample i = one document of the split: train shuffles each epoch with ``epoch_order``
        (seed ``random_seed``) and wraps around for ``num_samples``; valid/test go in order, once."""

        def __init__(self, corpus, dataset_path, indices, num_samples, index_split, config):
            super().__init__(corpus, dataset_path, indices, num_samples, index_split, config)
            if len(indices) == 0:
                raise ValueError(f"{dataset_path}: no documents in the {index_split.name} split "
                                 f"(data.split={config.split})")
            self.shuffle = index_split == Split.train
            self._perm = (-1, None)

        @staticmethod
        def numel_low_level_dataset(corpus) -> int:
            return len(corpus)

        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return Corpus(dataset_path, config.mmap_bin_files, config.vocab_size)

        @staticmethod
        def _key_config_attributes() -> list[str]:
            return ["random_seed", "split", "split_matrix", "max_tokens"]

        def __len__(self) -> int:
            return self.num_samples if self.num_samples is not None else len(self.indices)

        def _order(self, epoch: int) -> np.ndarray:
            if self._perm[0] != epoch:  # one epoch's permutation kept: 8 bytes per document
                self._perm = (epoch, epoch_order(len(self.indices), self.config.random_seed, epoch))
            return self._perm[1]

        def doc_ids(self, samples: np.ndarray) -> np.ndarray:
            """Document ids (rows of the corpus) of sample indices int64 [k]."""
            epoch, j = np.divmod(np.asarray(samples, dtype=np.int64), len(self.indices))
            if not self.shuffle:
                return self.indices[j]
            out = np.empty_like(j)
            for e in range(int(epoch.min(initial=0)), int(epoch.max(initial=-1)) + 1):
                sel = epoch == e
                out[sel] = self.indices[self._order(e)[j[sel]]]
            return out

        def lengths(self, samples: np.ndarray) -> np.ndarray:
            """Training positions of each sample (cut at ``max_tokens``; 0 for a 1-token document)."""
            n = self.dataset.tokens.sequence_lengths[self.doc_ids(samples)].astype(np.int64)
            return np.clip(np.minimum(n, self.config.max_tokens + 1) - 1, 0, None)

        def __getitem__(self, i: int) -> Document:
            e, j = divmod(int(i), len(self.indices))
            doc = self.indices[self._order(e)[j]] if self.shuffle else self.indices[j]
            return self.dataset.document(int(doc), self.config.max_tokens)

    _CLASSES = (DocumentDatasetConfig, DocumentDataset)
    return _CLASSES


class DocumentStream:
    """Samples 0, 1, 2, ... of a blend (or of one dataset), read by index: lengths for planning,
    documents for the micro-batches this rank trains on."""

    def __init__(self, build: Callable[[int], object], size: Optional[int]):
        self._build = build
        self.ds = build(size)

    def __len__(self) -> int:
        return len(self.ds)

    def _ensure(self, n: int) -> None:
        if n > len(self.ds):  # grown: the first len(ds) samples stay the same (see module doc)
            self.ds = self._build(max(2 * len(self.ds), n))

    def _parts(self, samples: np.ndarray):
        """(leaf dataset, positions into ``samples``, the leaf's sample indices) for each blend member."""
        if not hasattr(self.ds, "dataset_index"):
            return [(self.ds, np.arange(len(samples)), samples)]
        ds_id = np.asarray(self.ds.dataset_index[samples])
        ds_sample = np.asarray(self.ds.dataset_sample_index[samples])
        return [(self.ds.datasets[d], np.nonzero(ds_id == d)[0], ds_sample[ds_id == d]) for d in np.unique(ds_id)]

    def lengths(self, start: int, count: int) -> np.ndarray:
        self._ensure(start + count)
        samples = np.arange(start, start + count)
        out = np.zeros(count, dtype=np.int64)
        for leaf, pos, idx in self._parts(samples):
            out[pos] = leaf.lengths(idx)
        return out

    def document(self, i: int) -> Document:
        if not hasattr(self.ds, "dataset_index"):
            return self.ds[i]
        return self.ds.datasets[int(self.ds.dataset_index[i])][int(self.ds.dataset_sample_index[i])]

    def sources(self, start: int, count: int) -> np.ndarray:
        """Blend member (0, 1, ...) of each sample in [start, start + count)."""
        self._ensure(start + count)
        if not hasattr(self.ds, "dataset_index"):
            return np.zeros(count, dtype=np.int64)
        return np.asarray(self.ds.dataset_index[start: start + count], dtype=np.int64)

    def _length_iter(self, start: int, block: int = 4096):
        a, empty = start, 0
        while True:
            self._ensure(a + 1)  # grows only once the stream is used up
            k = min(block, len(self.ds) - a)
            lengths = self.lengths(a, k)
            empty = empty + k if not lengths.any() else 0
            if empty > 1 << 20:
                raise ValueError(f"data.train: samples {a + k - empty}..{a + k}: no document with 2 tokens or more")
            yield from lengths.tolist()
            a += k

    def plan(self, start: int, n_packs: int, budget: int) -> tuple[list[list[int]], list[int], int]:
        """The next ``n_packs`` micro-batches from sample ``start``: (sample indices of each, their
        token counts, the next sample)."""
        lengths, groups = [], []
        it = (lengths.append(n) or n for n in self._length_iter(start))
        for g in itertools.islice(greedy_packs(it, budget), n_packs):
            groups.append([start + i for i in g])
        sizes = [sum(lengths[i - start] for i in g) for g in groups]
        return groups, sizes, groups[-1][-1] + 1

    def batch(self, group: list[int], budget: int, multiple_of: int, pad_id: int) -> PackedBatch:
        """One micro-batch of the documents ``group`` (1-token documents have nothing to train on)."""
        docs = [d for d in (self.document(i) for i in group) if len(d) > 0]
        return pack(docs, budget, multiple_of, pad_id)[0]


def dataset_prefixes(data) -> list[str]:
    """Every indexed prefix an indexed ``data`` config reads (train or blend, and valid)."""
    out = parse_blend(data.blend)[0] if data.blend else parse_blend([data.train], "data.train")[0]
    if data.valid and not is_jsonl(data.valid):
        out += parse_blend(data.valid, "data.valid")[0]
    return out


def check_data(data) -> None:
    """Fail before any work on an indexed ``data`` config that cannot load (errors name the field)."""
    cfg = _config(data, data.seed, None)
    for blend in [cfg.blend] if cfg.blend is not None else cfg.blend_per_split:
        for prefix in (blend or ([], None))[0]:
            Corpus(prefix)  # opens the index (O(1)); streams that do not match raise here


def check_tokenizer(data, tokenizer, hf_dir: str) -> None:
    """Refuse indexed data that ``glm5 data preprocess`` tokenized with another tokenizer than the
    model's (``summary.json``'s ``tokenizer_id``, ``tokenizer_identity``): a tokenizer with the same
    vocabulary size would otherwise train on the wrong tokens. Other tools' prefixes record none."""
    mine = tokenizer_identity(tokenizer)
    for prefix in dataset_prefixes(data):
        s = preprocess_summary(prefix) or {}
        if s.get("tokenizer_id") not in (None, mine):
            raise ValueError(f"{Path(prefix).parent}: tokenized with another tokenizer ({s.get('tokenizer')}) than "
                             f"the model's ({hf_dir}); re-run glm5 data preprocess --hf-dir {hf_dir}")


def _config(data, seed: int, cache: Optional[str], vocab_size: int = 0):
    """Megatron's dataset config from ``data`` (the recipe's DataCfg): blend or blend_per_split."""
    Config, _ = _dataset_classes()
    train = parse_blend(data.blend) if data.blend else parse_blend([data.train], "data.train")
    prefixes, weights = train
    if weights is None and len(prefixes) > 1:  # Megatron's rule (weights = sizes), as weights
        weights = [float(len(Corpus(p).tokens)) for p in prefixes]  # so the stream can span epochs
    # mmap_bin_files=False: token files are read by offset (Megatron's _FileBinReader), so the loader's
    # resident memory holds what it reads, not mapped page cache of the whole corpus (.idx stays mapped)
    kw = dict(random_seed=seed, sequence_length=data.micro_batch_tokens, max_tokens=data.max_tokens,
              path_to_cache=cache, mid_level_dataset_surplus=0.005, mmap_bin_files=False, vocab_size=vocab_size)
    if data.valid:
        if data.split:
            raise ValueError("data.split and data.valid: give one (a split of data.train, or a validation set)")
        if is_jsonl(data.valid):
            raise ValueError(f"data.valid={data.valid}: indexed training data needs indexed validation data")
        return Config(blend_per_split=[(prefixes, weights), parse_blend(data.valid, "data.valid"), None], **kw)
    split = str(data.split or "100,0,0")
    if not re.fullmatch(r"\s*[.0-9]+(\s*[,/:\s]\s*[.0-9]+){0,2}\s*", split) or not any(
            float(x) for x in re.findall(r"[.0-9]+", split)):
        raise ValueError(f"data.split={data.split!r}: expected up to three non-negative weights, e.g. '969,30,1'")
    return Config(blend=(prefixes, weights), split=split, **kw)


def _valid_size(cfg) -> Optional[int]:
    """Documents of the validation split over all members when the blend is weighted (Megatron
    then needs a size), else None (one pass over each member)."""
    from megatron.core.datasets.utils import Split

    if cfg.blend_per_split is not None:
        prefixes, weights = cfg.blend_per_split[Split.valid.value]
        return None if weights is None else sum(len(Corpus(p)) for p in prefixes)
    prefixes, weights = cfg.blend
    span = cfg.split_matrix[Split.valid.value]
    if span is None:
        return 0
    if weights is None:
        return None
    n = [len(Corpus(p)) for p in prefixes]
    return sum(int(round(span[1] * k)) - int(round(span[0] * k)) for k in n)


def _estimate_samples(cfg, steps: int, global_batch_tokens: int, max_tokens: int) -> int:
    """Documents a run of ``steps`` will draw, from the mean document length (the .bin size over the
    document count: no pass over the index)."""
    prefixes, weights = cfg.blend if cfg.blend is not None else cfg.blend_per_split[0]
    weights = weights or [1.0] * len(prefixes)
    mean = 0.0
    for p, w in zip(prefixes, weights):
        c = Corpus(p)
        tokens = os.path.getsize(f"{p}.bin") / c.tokens.index.dtype_size
        mean += w / sum(weights) * min(tokens / max(len(c), 1), max_tokens + 1)
    return int(math.ceil(1.1 * steps * global_batch_tokens / max(mean - 1, 1.0))) + 64


class IndexedData:
    """The recipe's view of indexed data: ``step(sample)`` → this rank's micro-batches of the step
    starting at stream sample ``sample`` (+ the step's token count and the next sample), and the
    validation micro-batches of this rank."""

    def __init__(self, data, steps: int, accum: int, dp: int, dp_rank: int, multiple_of: int, pad_id: int,
                 cache: Optional[str], start_sample: int = 0, vocab_size: int = 0):
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.utils import Split

        _, DocumentDataset = _dataset_classes()
        self.cfg = _config(data, data.seed, cache, vocab_size)
        self.budget, self.accum, self.dp, self.dp_rank = data.micro_batch_tokens, accum, dp, dp_rank
        self.multiple_of, self.pad_id = multiple_of, pad_id
        valid = _valid_size(self.cfg)

        def build(size: int, split: Split = Split.train):
            sizes = [size if split == Split.train else 0, valid if split == Split.valid else 0, 0]
            cfg = copy.copy(self.cfg)  # only this split is built (and cached)
            if cfg.blend_per_split is not None:
                cfg.blend_per_split = [b if i == split.value else None for i, b in enumerate(cfg.blend_per_split)]
            else:
                cfg.split_matrix = [m if i == split.value else None for i, m in enumerate(cfg.split_matrix)]
            return BlendedMegatronDatasetBuilder(DocumentDataset, sizes, lambda: True, cfg).build()[split.value]

        n = max(_estimate_samples(self.cfg, steps, data.global_batch_tokens, data.max_tokens), start_sample + 1)
        self.train = DocumentStream(build, n)
        self.valid = DocumentStream(lambda _: build(0, Split.valid), None) if valid != 0 else None

    def step(self, sample: int) -> tuple[list[PackedBatch], int, int]:
        groups, sizes, nxt = self.train.plan(sample, self.accum * self.dp, self.budget)
        mine = groups[self.dp_rank * self.accum: (self.dp_rank + 1) * self.accum]
        return [self.train.batch(g, self.budget, self.multiple_of, self.pad_id) for g in mine], sum(sizes), nxt

    def valid_batches(self) -> list[PackedBatch]:
        """This rank's share of one pass over the validation documents (as the jsonl path splits them)."""
        if self.valid is None or self.valid.ds is None:
            return []
        lengths = self.valid.lengths(0, len(self.valid))
        groups = [g for g in greedy_packs(lengths.tolist(), self.budget) if lengths[g].any()]
        mine = groups[self.dp_rank::self.dp] or groups[:1]
        return [self.valid.batch(g, self.budget, self.multiple_of, self.pad_id) for g in mine]
