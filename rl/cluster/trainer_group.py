"""The trainer ranks on Ray: ``TrainerGroup`` starts ``trainer.world_size`` actors (one per rank, in a
placement group) that form one torch.distributed group — rank 0 picks the rendezvous address/port — each
holding a ``rl.train.trainer.PolicyTrainer``. Every call goes to all ranks (collectives inside); results come
from the reporting ranks; a rank that fails ends the wait in one line naming the rank and the method (Ray
start-up, resource checks and waits: ``rl.cluster.ray_jobs``).
"""

from __future__ import annotations

import socket
from pathlib import Path

import ray

from glm5_mcore.checkpoint.layout import latest_iteration
from rl.cluster.ray_jobs import RayJobError, cause_line, node_id, wait_for


@ray.remote
class TrainerActor:
    def node_address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, cfg, rank: int, world: int, addr: str, port: int) -> bool:
        from rl.train.trainer import PolicyTrainer

        self.trainer = PolicyTrainer(cfg, rank, world, addr, port)
        return self.trainer.reports

    def call(self, method: str, *args, **kwargs):
        return getattr(self.trainer, method)(*args, **kwargs)

    def node_id(self) -> str:
        return node_id()


class TrainerGroup:
    def __init__(self, cfg):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t = cfg.trainer
        bundle = {"CPU": 1, **({"GPU": t.gpus_per_rank} if t.gpus_per_rank else {})}
        self.out, self.actors = t.out, []
        self.pg = placement_group([dict(bundle) for _ in range(t.world_size)], strategy=cfg.ray.placement_strategy)
        share = 1.0 - cfg.rollout.colocate.engine_fraction if cfg.rollout.colocate.enable else 1.0
        try:
            wait_for([self.pg.ready()], f"the placement group of the {t.world_size} trainer ranks", cfg)
            self.actors = [TrainerActor.options(
                num_cpus=share, num_gpus=t.gpus_per_rank * share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)).remote()
                for r in range(t.world_size)]
            addr, port = self.gather([self.actors[0].node_address.remote()], "TrainerActor.node_address")[0]
            self.initializing = [a.init.remote(cfg, r, t.world_size, addr, port) for r, a in enumerate(self.actors)]
        except BaseException:
            self.shutdown()
            raise
        self.reporting: list = []

    def ready(self) -> "TrainerGroup":
        """Wait until every rank has built its model, loaded its checkpoint and optimizer (``PolicyTrainer``);
        the constructor only starts that, so the driver starts the rollout engines meanwhile (the two
        start-ups overlap: on a GPU cluster both load hundreds of GB). Idempotent; returns ``self``."""
        if self.initializing:
            refs, self.initializing = self.initializing, []
            try:
                self.reporting = self.gather(refs, "TrainerActor.init")
            except BaseException:
                self.shutdown()
                raise
        return self

    def gather(self, refs: list, method: str) -> list:
        """``ray.get`` of one call per rank, taken as they finish: the first rank that fails ends the wait
        (the others may be blocked in a collective with it) with one line naming the rank and method; a
        rank that died says the same command resumes from the run's latest checkpoint."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = refs.index(ready[0])
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                try:
                    step = latest_iteration(self.out) if (Path(self.out) / "latest").is_file() else None
                except (ValueError, OSError):
                    step = None
                again = (f"the same command resumes from its latest checkpoint (step {step} in {self.out})"
                         if step is not None else "no checkpoint was saved yet (trainer.save_every), so the same "
                                                  "command starts over")
                raise RayJobError(f"trainer rank {rank} died in {method} ({cause_line(e)}); {again}") \
                    from None
            except ray.exceptions.RayTaskError as e:
                raise RayJobError(f"trainer rank {rank}, {method}: {cause_line(e)}") from None
        return ray.get(refs)

    def call(self, method: str, *args, **kwargs) -> list:
        """``method`` on every rank; the reporting ranks' results (in rank order)."""
        self.ready()
        args = [ray.put(a) if len(self.actors) > 1 else a for a in args]  # one copy in the object store
        refs = [a.call.remote(method, *args, **kwargs) for a in self.actors]
        out = self.gather(refs, f"PolicyTrainer.{method}")
        return [o for o, rep in zip(out, self.reporting) if rep]

    def first(self, method: str, *args, **kwargs):
        self.ready()
        res = [a.call.remote(method, *args, **kwargs) for a in self.actors]
        return self.gather(res, f"PolicyTrainer.{method}")[0]

    def nodes(self) -> list[str]:
        """The Ray node id of each rank (rank order)."""
        return ray.get([a.node_id.remote() for a in self.actors])

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        ray.util.remove_placement_group(self.pg)
