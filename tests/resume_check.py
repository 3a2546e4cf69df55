"""Run under torchrun: three SFT runs in one process group — ``a`` uninterrupted to ``steps``, ``b``
stopped at ``steps // 2`` (its checkpoint), then ``b`` resumed to ``steps``. Prints one JSON line of
their losses (rank 0)."""

import json
import sys

import torch.distributed as dist

from recipes.cli import compose
from recipes.sft import SFTConfig, run


def main(out: str, steps: int, *overrides: str) -> None:
    losses = {}
    for name, n in (("a", steps), ("b_first", steps // 2), ("b_resumed", steps)):
        cfg = SFTConfig.from_dict(compose("sft", [*overrides, f"train.steps={n}",
                                                  f"train.out={out}/{name[0]}"]))
        losses[name] = [h["loss"] for h in run(cfg)["history"]]
    if dist.get_rank() == 0:
        print(json.dumps(losses), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
