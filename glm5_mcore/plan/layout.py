"""A Megatron-Core parallel layout and the kinds of rank it has.

Megatron's rank order is ``tp-cp-ep-dp-pp``: pipeline stage ``p`` holds global ranks
``[p·world/pp, (p+1)·world/pp)``. Inside a stage every rank holds the same bytes (TP shards are equal,
each EP rank holds ``experts/ep`` experts of every MoE layer), so a rank's memory depends only on its
stage: the first (embedding, the dense layers), a middle one, the last (final norm, output layer and the
MTP layer, which with PP > 1 also keeps its own copy of the word embedding).
"""

from __future__ import annotations

from dataclasses import dataclass

from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import check_model_split, padded_vocab_size


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    cp: int = 1
    make_vocab_size_divisible_by: int = 1
    """The run's vocabulary padding (``ParallelConfig.make_vocab_size_divisible_by``)."""

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense parameters (CP ranks share them too)."""
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def dp_cp(self) -> int:
        """The group Megatron's DDP reduces dense gradients over (and the distributed optimizer shards by)."""
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the routed experts (Megatron's expert-data-parallel group)."""
        return self.world // (self.etp * self.ep * self.pp)

    def validate(self, model: GLM5Config) -> None:
        """ValueError naming the field for a layout Megatron-Core (or GLM-5) cannot form."""
        for name in ("world", "tp", "ep", "etp", "pp", "cp", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.world % (self.tp * self.cp * self.pp):
            raise ValueError(f"tp*cp*pp={self.tp * self.cp * self.pp} does not divide the world size {self.world}")
        if self.world % (self.etp * self.ep * self.pp):
            raise ValueError(f"etp*ep*pp={self.etp * self.ep * self.pp} does not divide the world size {self.world}")
        check_model_split(model, tp=self.tp, ep=self.ep, etp=self.etp, pp=self.pp)

    def vocab_rows(self, model: GLM5Config) -> int:
        """Embedding / output-layer rows on one TP rank: the padded vocabulary over TP (``padded_vocab_size``)."""
        return padded_vocab_size(model.vocab_size, self.tp, self.make_vocab_size_divisible_by) // self.tp

    def stage_layers(self, model: GLM5Config, stage: int) -> range:
        """Decoder layer indices (0-based) on pipeline ``stage`` (Megatron's even split)."""
        n = model.num_hidden_layers // self.pp
        return range(stage * n, (stage + 1) * n)

    def stage_rank(self, stage: int) -> int:
        """The first global rank of pipeline ``stage``."""
        return stage * (self.world // self.pp)

    def describe(self) -> str:
        return (f"world {self.world} = TP {self.tp} x CP {self.cp} x PP {self.pp} x DP {self.dp}; "
                f"experts EP {self.ep} x ETP {self.etp} x EDP {self.expert_dp}")

    def as_dict(self) -> dict:
        return {"world": self.world, "tp": self.tp, "ep": self.ep, "etp": self.etp, "pp": self.pp, "cp": self.cp,
                "dp": self.dp}


@dataclass(frozen=True)
class RankKind:
    """One kind of rank: a pipeline stage, named for what it holds."""

    name: str
    stage: int
    rank: int
    first: bool
    last: bool


def rank_kinds(layout: Layout, mtp: bool) -> list[RankKind]:
    """First stage, one middle stage (if any), last stage (``+MTP`` when it holds the MTP layer)."""
    last_name = "last stage" + (" + MTP" if mtp else "")
    if layout.pp == 1:
        return [RankKind("every rank" + (" (MTP)" if mtp else ""), 0, 0, True, True)]
    stages = [0] + ([layout.pp // 2] if layout.pp > 2 else []) + [layout.pp - 1]
    out = []
    for s in stages:
        name = "first stage" if s == 0 else (last_name if s == layout.pp - 1 else f"middle stage {s}")
        out.append(RankKind(name, s, layout.stage_rank(s), s == 0, s == layout.pp - 1))
    return out
