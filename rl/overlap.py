"""Where each step's samples come from: ``StepSource`` draws the step's prompts, generates, scores,
applies DAPO's dynamic sampling (``rl.shaping``), and — with ``trainer.off_policy_steps=1`` — starts
the next step's generation as soon as this step's samples are in, so the engines generate step n+1
with adapter version n while the trainer updates on step n (verl's one-step-off-policy recipe; the new
adapter is queued behind that generation by ``RolloutPool.sync(wait=False)``).

Everything that decides a sample is fixed by the step, not by timing: prompts come from the epoch
stream in step order (refill rounds included, before the next step is drawn), seeds from
(step, round, prompt, sample), and the adapter version of round 0 of step s is s-1 with overlap (s
without); refill rounds run on the newest adapter. The version travels with each sample
(``rollout/staleness`` = trainer version − sample version). A checkpoint written while step s+1's
batch is in flight keeps the adapter it was generated with (``inflight_payload``), so a resumed run
regenerates that batch exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rl.rollout.base import Request, sample_seed
from rl.shaping import GroupFilter, shape_scores
from rl.tasks import next_prompts


@dataclass
class StepSamples:
    prompts: list
    results: list
    scores: torch.Tensor
    """[B] rewards after the overlong penalty (what the advantages use)."""
    versions: torch.Tensor
    """[B] adapter version each sample was generated with."""
    metrics: dict


class StepSource:
    def __init__(self, cfg, train: list, rollouts, sampling, rewards, state: dict, resume_payload=None):
        self.cfg, self.train, self.rollouts, self.sampling, self.rewards = cfg, train, rollouts, sampling, rewards
        self.pos = {"epoch": state["epoch"], "cursor": state["cursor"]}
        self.ahead = None  # (step, prompts, job) of the prefetched round 0
        self.resume_payload = resume_payload
        self.overlap = cfg.trainer.off_policy_steps > 0

    @property
    def inflight_payload(self):
        """The adapter the in-flight next step is generated with (saved with checkpoints), or None."""
        return self.ahead[2]["payload"] if self.ahead is not None else None

    def _requests(self, prompts, step: int, rnd: int) -> list[Request]:
        seed = self.cfg.trainer.seed + 7919 * rnd
        return [Request((p.index, k), p.ids, sample_seed(seed, step, p.index, k))
                for p in prompts for k in range(self.cfg.rollout.n)]

    def _submit(self, step: int, rnd: int):
        prompts = next_prompts(self.train, self.cfg.data.prompts_per_step, self.cfg.data.seed, self.pos)
        return prompts, self.rollouts.submit(self._requests(prompts, step, rnd), self.sampling)

    def _start_first(self, step: int):
        """Round 0 of ``step`` when nothing is in flight (the first step, or a resumed in-flight step)."""
        if self.resume_payload is not None and self.overlap:
            current = self.rollouts.payload
            self.rollouts.sync(self.resume_payload)
            prompts, job = self._submit(step, 0)
            self.rollouts.sync(current, wait=False)
        else:
            prompts, job = self._submit(step, 0)
        self.resume_payload = None
        return prompts, job

    def take(self, step: int, state: dict) -> StepSamples:
        """Step ``step``'s samples; advances ``state``'s data position past every prompt they used."""
        n = self.cfg.rollout.n
        fg = self.cfg.algorithm.filter_groups
        if self.ahead is not None and self.ahead[0] == step:
            _, prompts, job = self.ahead
        else:
            prompts, job = self._start_first(step)
        self.ahead = None
        filt = GroupFilter(self.cfg.data.prompts_per_step, n, fg.metric, fg.enable)
        versions, t_reward, rnd = {}, 0.0, 0
        while True:
            results = self.rollouts.collect(job)
            for res in results:
                versions[(rnd, res.key)] = job["version"]
            t0 = time.perf_counter()
            raw = self.rewards(prompts, results, n)
            lengths = torch.tensor([len(r.response_ids) for r in results])
            shaped, shape_m = shape_scores(self.cfg, raw, lengths)
            t_reward += time.perf_counter() - t0
            for res in results:
                res.round = rnd
            filt.add(prompts, results, raw, shaped)
            rnd += 1
            limit = fg.max_num_gen_batches
            if filt.full or not fg.enable or (limit > 0 and rnd >= limit):
                break
            prompts, job = self._submit(step, rnd)
        prompts, results, raw, shaped, metrics = filt.take()
        metrics.update(shape_m)
        state["epoch"], state["cursor"] = self.pos["epoch"], self.pos["cursor"]
        if self.overlap and step + 1 < self.cfg.trainer.steps:
            self.ahead = (step + 1, *self._submit(step + 1, 0))
        ver = torch.tensor([versions[(r.round, r.key)] for r in results], dtype=torch.float32)
        stale = step - ver
        metrics.update({"rollout/staleness": float(stale.mean()), "rollout/staleness_max": float(stale.max()),
                        "timing_s/reward": t_reward})
        return StepSamples(prompts, results, shaped, ver, metrics)
