"""One colocated engine over both nodes' bundles (``tests/cluster/test_ray_nodes.py``), in a process of its own:
argv ray address, tiny_dir, out; the trainer's placement group (2 bundles, STRICT_SPREAD) with a trainer-share actor
in each bundle, a ``RolloutPool`` of one ``SpanProbeEngine`` (tensor_parallel_size 2) placed by
``rl.cluster.engine_placement``; prints {"driver", "placed", "trainer_nodes"} as one JSON line."""

import json
import sys

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl.cluster.rollout_pool import RolloutPool
from glm5_mcore.training.schema import build
from rl.config import RLConfig


@ray.remote
class TrainerShare:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def main() -> None:
    address, tiny_dir, out = sys.argv[1:4]
    ray.init(address=address, log_to_driver=False)
    cfg = build(RLConfig, {"model": {"hf_dir": tiny_dir}, "wandb": {"mode": "disabled"},
                           "trainer": {"world_size": 2, "out": out},
                           "rollout": {"engine": "tests.support.span_engine.SpanProbeEngine", "num_actors": 1,
                                       "engine_kwargs": {"tensor_parallel_size": 2},
                                       "colocate": {"enable": True}}})
    f = cfg.rollout.colocate.engine_fraction
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=300)
    trainers = [TrainerShare.options(num_cpus=1 - f, scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=r)).remote() for r in range(2)]  # as TrainerGroup shares its bundles
    trainer_nodes = ray.get([t.node.remote() for t in trainers])
    pool = RolloutPool(cfg, pg)
    print(json.dumps({"driver": pool.nodes(), "placed": pool.sync(None), "trainer_nodes": trainer_nodes}))
    pool.shutdown()


if __name__ == "__main__":
    main()
