"""Run under torchrun: for each layout (``dp2``: plain DP 2; ``tp2``: TP 2), three SFT runs in one
process group — ``a`` uninterrupted to ``steps``, ``b`` stopped at ``steps // 2`` (its checkpoint),
then ``b`` resumed to ``steps``. Prints one JSON line of their losses per layout (rank 0)."""

import json
import sys

import torch.distributed as dist

from recipes.cli import compose
from recipes.sft import SFTConfig, run

LAYOUTS = {"dp2": [], "tp2": ["parallel.tp=2"]}


def main(out: str, steps: int, *overrides: str) -> None:
    losses = {}
    for layout, extra in LAYOUTS.items():
        for name, n in (("a", steps), ("b_first", steps // 2), ("b_resumed", steps)):
            cfg = SFTConfig.from_dict(compose("sft", [*overrides, *extra, f"train.steps={n}",
                                                      f"train.out={out}/{layout}/{name[0]}"]))
            losses.setdefault(layout, {})[name] = [h["loss"] for h in run(cfg)["history"]]
    if dist.get_rank() == 0:
        print(json.dumps(losses), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
