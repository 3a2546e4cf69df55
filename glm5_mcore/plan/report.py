"""The plan as text: one column per kind of rank, the rollout engine, the verdict."""

from __future__ import annotations

from glm5_mcore.plan.cluster import GIB
from glm5_mcore.plan.colocate import ENGINE_ASLEEP, ENGINE_CONTEXT, PCIE_GBPS, SYNC_BUCKET
from glm5_mcore.plan.host import format_host
from glm5_mcore.plan.rollout import ACTIVATION_RESERVE
from glm5_mcore.plan.planner import Plan


DSA_STAGE_LABELS = {"sparse": "sparse", "sparse_loss": "sparse+loss", "warmup": "warm-up"}
"""The report's name of each indexer training stage (``plan.activations.DSA_STAGES``)."""


def _g(x: int) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(plan: Plan) -> str:
    job, L = plan.job, plan.job.layout
    lines = [f"{job.kind} job on {plan.cluster.describe()}, {plan.cluster.usable_bytes / GIB:.1f} GiB usable per GPU",
             f"trainer: {L.describe()}; micro-batch {job.micro_batch_tokens} tokens, "
             f"{'bf16' if job.bf16 else 'fp32'}, {'LoRA r=%d' % job.lora[1] if job.lora else 'full fine-tuning'}, "
             f"{'frozen base FP8 (1 byte + a 128x128 block scale; activations and adapters ' + ('bf16' if job.bf16 else 'fp32') + '), ' if job.base_fp8 else ''}"
             f"recompute {({True: 'full', False: 'off'}.get(job.recompute, job.recompute))}, distributed optimizer {'on' if job.dist_opt else 'off'}",
             ""]
    w = 20
    head = "GiB per GPU".ljust(30) + "".join(f"{r.kind.name[:w]:>{w}}" for r in plan.ranks)
    lines.append(head)
    lines.append("-" * len(head))

    def row(label, f):
        lines.append(label.ljust(30) + "".join(f"{f(r):>{w}}" for r in plan.ranks))

    row("rank", lambda r: str(r.kind.rank))
    row("parameters (B)", lambda r: f"{r.state.params / 1e9:.3f}")
    row("  routed experts (B)", lambda r: f"{r.state.expert_params / 1e9:.3f}")
    row("  trainable (B)", lambda r: f"{r.state.trainable / 1e9:.4f}")
    row("weights + buffers", lambda r: _g(r.state.weights + r.state.buffers).strip())
    row("gradients", lambda r: _g(r.state.grads).strip())
    row("fp32 main params", lambda r: _g(r.state.main_params).strip())
    row("  with distributed optimizer", lambda r: _g(r.state.main_params_dist).strip())
    row("Adam state", lambda r: _g(r.state.optimizer).strip())
    row("  with distributed optimizer", lambda r: _g(r.state.optimizer_dist).strip())
    row("activations, no recompute", lambda r: _g(r.act_no_recompute.peak).strip())
    row("activations, full recompute", lambda r: _g(r.act_recompute.peak).strip())
    row("  DSA indexer scores", lambda r: _g(r.act.indexer_scores).strip())
    row("  DSA core backward", lambda r: _g(r.act.dsa_backward).strip())
    if any(r.dsa_layer for r in plan.ranks):
        for stage, label in DSA_STAGE_LABELS.items():
            mark = " (job)" if stage == job.dsa_stage else ""
            row(f"  DSA layer: {label}{mark}", lambda r, st=stage: _g(r.dsa_layer.get(st, 0)).strip())
    row("  MoE dispatch buffers", lambda r: _g(r.act.dispatch).strip())
    row("  micro-batches in flight", lambda r: str(r.act.in_flight))
    if any(r.te_copy for r in plan.ranks):
        row("FP8 base's copy inside a backward", lambda r: _g(r.te_copy).strip())
    row("TOTAL (this job)", lambda r: _g(r.total).strip())
    row("capacity", lambda r: _g(r.capacity).strip())
    row("fits", lambda r: "yes" if r.fits else "NO")
    if plan.phases is not None:
        lines += [""] + format_phases(plan)
    elif plan.engine is not None:
        e, ro = plan.engine, job.rollout
        s = e.spec
        lines += ["", f"rollout: {ro.engines} engine(s) x {s.gpus} GPUs (vLLM tensor_parallel_size={s.tp}, "
                      f"pipeline_parallel_size={s.pp}, data_parallel_size={s.dp}, "
                      f"enable_expert_parallel={s.expert_parallel}), weights {'FP8' if s.fp8 else 'bf16'}",
                  f"  weights per GPU {e.weights / GIB:.2f} GiB; KV cache {e.kv_per_token / 1024:.1f} KiB per token "
                  f"per GPU (a group of n={ro.n} x {ro.prompt_tokens + ro.response_tokens} tokens: "
                  f"{ro.n * (ro.prompt_tokens + ro.response_tokens) * e.kv_per_token / GIB:.1f} GiB), "
                  f"budget {e.kv_budget / GIB:.2f} GiB; {e.sequences} sequences of "
                  f"{ro.prompt_tokens}+{ro.response_tokens} tokens at once per engine (a group is n={ro.n}): "
                  f"{'fits' if e.fits else 'DOES NOT FIT: ' + e.why}"]
    if plan.push:
        lines += format_push(plan)
    if plan.host is not None:
        lines += [""] + format_host(plan.host, plan.cluster, job.base_fp8 and job.backend == "te")
    lines.append("")
    need = job.trainer_gpus + job.rollout_gpus
    if plan.fits:
        lines.append(f"verdict: fits ({need} GPUs of {plan.cluster.num_gpus}; fullest trainer rank "
                     f"{plan.worst.total / GIB:.1f} of {plan.worst.capacity / GIB:.1f} GiB)")
    else:
        lines.append("verdict: does not fit")
        lines += [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)


def format_layout_row(p: Plan) -> str:
    L, r = p.job.layout, p.worst
    return (f"  {L.world:5d} GPUs  TP {L.tp} EP {L.ep} ETP {L.etp} PP {L.pp} CP {L.cp} DP {L.dp}: "
            f"fullest rank {r.total / GIB:.1f} GiB ({r.kind.name})")


def format_phases(plan: Plan) -> list[str]:
    """The colocated per-GPU table: training phase vs generation phase."""
    p, ro = plan.phases, plan.job.rollout
    e = ro.engine
    w = 18
    out = [f"colocated: {ro.engines} engine(s) x {e.gpus} GPUs on the trainer's GPUs (vLLM tensor_parallel_size={e.tp}, "
           f"pipeline_parallel_size={e.pp}, enable_expert_parallel={e.expert_parallel}, weights {'FP8' if e.fp8 else 'bf16'}, "
           f"gpu_memory_utilization={e.gpu_memory_utilization:g}), sleep level {p.sleep_level}",
           "GiB per GPU".ljust(34) + "training phase".rjust(w) + "generation phase".rjust(w),
           "-" * (34 + 2 * w)]

    def row(label, a, b):
        f = lambda x: x if isinstance(x, str) else f"{x / GIB:.2f}"  # noqa: E731
        out.append(label.ljust(34) + f(a).rjust(w) + f(b).rjust(w))

    row("trainer weights + buffers", p.trainer_weights, p.trainer_resident)
    row("trainer grads + optimizer + acts", p.trainer_total - p.trainer_weights, 0)
    row("engine weights", 0, p.engine_weights)
    row("engine KV cache (its budget)", 0, p.kv_budget)
    row("  one group of n sequences", "-", p.kv_group)
    row("engine asleep / reserve + context", ENGINE_ASLEEP, ACTIVATION_RESERVE + ENGINE_CONTEXT)
    row("TOTAL", p.training, p.generation)
    row("capacity", p.capacity, p.capacity)
    if p.push:
        out.append(f"weight sync (weights awake, KV not yet): {p.push / GIB:.2f} GiB, one bucket of "
                   f"{SYNC_BUCKET / GIB:.0f} GiB + the rollout actor's context included")
    out.append(f"per GPU: {p.per_gpu / GIB:.2f} GiB of {p.capacity / GIB:.2f} "
               f"({'fits' if p.fits else 'DOES NOT FIT'}); {p.sequences} sequences of "
               f"{ro.prompt_tokens}+{ro.response_tokens} tokens at once; offload "
               f"({'grads, optimizer, frozen weights' if p.offload_weights else 'grads, optimizer'}; engine sleep "
               f"level {p.sleep_level}) moves {p.move_bytes / GIB:.1f} GiB per GPU per step: "
               f"{p.move_seconds:.1f} s at {PCIE_GBPS:g} GB/s")
    return out


def format_rl_row(x) -> str:
    """One ``search.RLLayout``."""
    L, e = x.trainer.job.layout, x.engine
    head = (f"  {x.gpus:5d} GPUs  {x.mode:9s}  trainer TP {L.tp} EP {L.ep} CP {L.cp} DP {L.dp}; {x.engines} engine(s) "
            f"TP {e.tp} PP {e.pp} DP {e.dp}{' FP8' if e.fp8 else ''}: fullest GPU {x.per_gpu / GIB:.1f} GiB")
    if x.phases is not None:
        p = x.phases
        head += (f" (training {p.training / GIB:.1f} / generation {p.generation / GIB:.1f}, "
                 f"gpu_memory_utilization={e.gpu_memory_utilization:g}, "
                 f"{'offload weights, ' if p.offload_weights else ''}{p.move_seconds:.1f} s offload per step)")
    return head


def format_push(plan: Plan) -> list[str]:
    """The adapter push per engine per step, and (LoRA mode) vLLM's LoRA buffers per GPU."""
    ro, push = plan.job.rollout, plan.push
    routed = sum(v for k, v in push.items() if k.startswith("experts."))
    if ro.merge:
        return [f"adapter push (merged): {sum(push.values()) / 1e9:.1f} GB per engine per step, {routed / 1e9:.1f} GB "
                "of it routed experts (every expert of an adapted layer: vLLM's FusedMoE)"]
    merged = {k.removeprefix("merged:"): v for k, v in push.items() if k.startswith("merged:")}
    lora = sum(v for k, v in push.items() if not k.startswith("merged:"))
    e = ro.engine
    out = [f"adapter push (LoRA mode): {lora / 1e9:.2f} GB of adapter per engine per step ({routed / 1e9:.2f} GB routed "
           f"experts){'' if not merged else f' + {sum(merged.values()) / 1e9:.2f} GB merged ' + ', '.join(merged)}"]
    if plan.lora_buffers:
        out.append(f"engine LoRA buffers: {plan.lora_buffers / GIB:.2f} GiB per GPU (max_loras {e.max_loras} x "
                   f"max_lora_rank {e.max_lora_rank}, every local routed expert; in the engine weights above)")
    return out
