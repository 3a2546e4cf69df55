"""``RLConfig``: the RL run as plain dataclasses (Hydra stops at the entry point, ``recipes.cli``).

Key names follow verl where verl has the concept (``algorithm.adv_estimator``,
``algorithm.rollout_correction.rollout_is_threshold``, ``actor.clip_ratio_low``, ``actor.loss_agg_mode``,
``actor.ppo_mini_batch_size``, ``rollout.n`` ...), so a verl user's settings carry over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.training.schema import LoRACfg, ModelCfg, PlanCfg, WandbCfg, build
from glm5_mcore.training.resume import file_fingerprint, model_fingerprint
from rl.validate import validate

@dataclass
class DataCfg:
    train: Optional[str] = "toy"
    """A jsonl, parquet or HF ``datasets`` folder with verl's columns (``rl.tasks.datasets``), or ``toy`` /
    ``toy_tool`` (the built-in tasks a tiny random GLM-5 can learn, ``rl.tasks.prompts``)."""
    val: Optional[str] = "toy"
    columns: dict = field(default_factory=dict)
    """Other column names: field → column, e.g. ``{prompt: question, ground_truth: reward_model.answer}``
    (fields: prompt, ground_truth, data_source, extra_info; a dotted column reaches into a struct)."""
    prompts_per_step: int = 16
    """verl's ``data.train_batch_size``: prompts per step (each sampled ``rollout.n`` times)."""
    val_prompts: int = 32
    chat_template: bool = False
    max_prompt_tokens: int = 512
    seed: int = 1234
    toy_size: int = 1024


@dataclass
class MultiTurnCfg:
    """Tool episodes (``rl.tasks.episodes``; verl's ``rollout.multi_turn`` keys where they exist): each assistant
    turn runs until a tool-call stop token (or EOS / the turn's ``max_new_tokens``); a turn ending in a
    tool-call stop token goes to ``env``, whose observation is appended in the chat template's
    ``observation_role`` and the episode continues, up to ``max_assistant_turns``."""
    enable: bool = False
    env: str = "rl.tasks.envs.toy_lookup_env"
    """``module.fn`` / ``file.py:fn``: ``env(prompt, episode, **env_kwargs) -> str | None`` (texts decoded with
    special tokens; None ends the episode); ``rl.tasks.code_env.python_tool``: the Python sandbox."""
    env_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of ``env``. An env may define ``check_kwargs(env_kwargs)`` and ``check_machine() ->
    str``, run before Ray starts (``rl.tasks.checks``); the code tool's are ``rl.tasks.sandbox.SandboxLimits``
    (unknown keys, types and ranges refused), and it refuses a machine that cannot isolate its calls."""
    tool_workers: int = 2
    tool_timeout_s: float = 60.0
    """``env`` runs in ``tool_workers`` processes per rollout actor (``rl.tasks.proc_pool``; 0: in the actor, no
    timeout); a call past ``tool_timeout_s`` wall seconds (finite, > 0; more than the code tool's ``wall_s``)
    is stopped, its worker's whole process group killed, and the observation says so."""
    tool_call_stop_tokens: list = field(default_factory=list)
    """Token ids or token strings (e.g. GLM's ``<|observation|>``) that end a turn with a tool call."""
    max_assistant_turns: int = 2
    max_tool_response_length: int = 64
    """Observation tokens kept per tool call (the rest is cut)."""
    observation_role: str = "observation"


@dataclass
class ColocateCfg:
    """Trainer and engines time-share the same GPUs (``rl.schedule.colocate``; verl's and slime's default): each
    engine actor sits in the trainer's placement-group bundles with a fraction of their GPU and CPU, and
    every step runs offload trainer → wake weights → push → wake KV cache → generate → sleep → restore
    trainer → the trainer's passes."""
    enable: bool = False
    engine_fraction: float = 0.5
    """The share of each bundle's GPU (and CPU) the engine actor reserves; the trainer rank takes the rest
    (Ray's fractional resources: both see the same device)."""
    sleep_level: Optional[int] = None
    """vLLM's ``LLM.sleep(level)``; None: 1 with a LoRARequest adapter (the base never changes: it waits in
    host memory), 2 with merged pushes (the weights change every step: discarded, the push brings them
    all back)."""
    offload_weights: bool = False
    """Also move the trainer's frozen base weights to host memory during generation (``glm5 plan`` says
    when the generation phase needs their memory)."""


@dataclass
class RolloutCfg:
    engine: str = "rl.rollout.hf_engine.HFRolloutEngine"
    """Dotted path of a ``rl.rollout.base.RolloutEngine``; ``rl.rollout.vllm_engine.VLLMRolloutEngine`` on GPU."""
    num_actors: int = 2
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop_token_ids: Optional[list] = None
    """None: the tokenizer's EOS."""
    deterministic_topk: bool = True
    """Tie-stable indexer top-k in the engine (the trainer's top-k is always deterministic)."""
    max_restarts: int = 3
    batch_prompts: bool = True
    """All of an actor's prompts in one batched decode (False: one prompt at a time, for benchmarks)."""
    gpus_per_actor: float = 0.0
    hf_dir: Optional[str] = None
    """The HF folder with weights the engines serve (and merged pushes read); None: found from ``model``
    (``glm5_mcore.checkpoint.layout.serving_dir``). A folder without weights is refused."""
    engine_kwargs: dict = field(default_factory=dict)
    routes_inline_bytes: int = 16384
    """A sample's R3 routes (``rl.rollout.routes``) up to this size travel in its result, larger ones by Ray
    ``ObjectRef`` (never through the driver): a ``ray.put`` costs the engine about a millisecond whatever the
    size; 16 KiB is 26 tokens' routes at 744B. 0: every sample's routes by reference."""
    multi_turn: MultiTurnCfg = field(default_factory=MultiTurnCfg)
    colocate: ColocateCfg = field(default_factory=ColocateCfg)


@dataclass
class OverlongBufferCfg:
    """DAPO's soft overlong punishment (verl's ``overlong_buffer`` keys): a response longer than
    ``rollout.max_new_tokens - len`` gets ``min(-(L - (max_new_tokens - len)) / len · penalty_factor, 0)``
    added to its reward (-penalty_factor at the token budget)."""
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = True


@dataclass
class RewardCfg:
    fn: str = "rl.tasks.rewards.toy_residue"
    """Dotted path or verl's ``/path/file.py:compute_score``: ``fn(data_source, solution_str, ground_truth,
    extra_info) -> float`` (verl's ``compute_score`` signature), or with ``batched`` lists in, a list of
    floats out; or a built-in name: ``math`` (math-verify), ``exact_match``, ``math_answer``."""
    batched: bool = False
    kwargs: dict = field(default_factory=dict)
    num_workers: int = 2
    timeout_s: float = 30.0
    """``num_workers`` processes score the samples (``rl.tasks.proc_pool``; 0: in the driver, no isolation), a
    sample (a chunk with ``batched``) past ``timeout_s`` wall seconds (finite, > 0) is stopped: its worker's
    whole process group is killed."""
    timeout_score: float = 0.0
    error_score: float = 0.0
    """The scores of a sample whose call timed out / raised or crashed (``reward/timeouts``, ``reward/errors``);
    finite numbers."""
    max_error_fraction: float = 1.0
    """A scoring call (a step's batch) whose share of failed samples (timed out, raised, crashed) reaches
    this stops the run in one line naming the function and the first failure; 1.0: only when every
    sample failed (a reward function that can never score, e.g. the wrong signature)."""
    overlong_buffer: OverlongBufferCfg = field(default_factory=OverlongBufferCfg)


@dataclass
class FilterGroupsCfg:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): prompt groups whose ``metric`` is
    the same for all ``rollout.n`` samples (no GRPO signal) are dropped and further prompts drawn until
    ``data.prompts_per_step`` groups are kept or ``max_num_gen_batches`` generation rounds ran (<= 0: no
    limit, but a step that has drawn every prompt of ``data.train`` once without filling stops the run with
    one line saying so, instead of regenerating forever); a step that hits the limit is topped up with
    dropped groups (zero advantage) and says so. In async mode (``trainer.max_staleness``) a uniform group
    leaves the buffer as soon as it is scored and the next prompt is admitted in its place, with the same
    bound per step (``rl.schedule.async_source.AsyncSource``)."""
    enable: bool = False
    metric: str = "score"
    """``score`` (the reward function's value) or ``seq_reward`` (after the overlong penalty)."""
    max_num_gen_batches: int = 10


@dataclass
class RolloutCorrectionCfg:
    rollout_is: Optional[str] = "token"
    rollout_is_threshold: Any = "0.5_5.0"
    """``"lo_hi"``: IcePop (weight k inside [lo, hi], 0 outside); a float C: truncated IS min(k, C)."""
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Any = None


@dataclass
class KLCtrlCfg:
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class AlgorithmCfg:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlCfg = field(default_factory=KLCtrlCfg)
    filter_groups: FilterGroupsCfg = field(default_factory=FilterGroupsCfg)
    mask_truncated_responses: bool = False
    """DAPO's overlong filtering: responses cut by ``rollout.max_new_tokens`` carry no loss (their rewards
    still count in their group's statistics)."""
    rollout_correction: RolloutCorrectionCfg = field(default_factory=RolloutCorrectionCfg)
    router_replay: bool = False
    """R3 (``rl.train.routing``): the trainer routes every token through the experts the rollout engine chose, in the
    old-log-prob, reference and update forwards (Megatron-Core's ``RouterReplay``)."""


@dataclass
class ActorCfg:
    foreign_names: ClassVar[dict] = {  # verl's micro-batch keys: refused, naming ours
        "ppo_max_token_len_per_gpu": "verl's name; here actor.micro_batch_tokens, counted per pack before the "
                                     "trainer.cp split",
        "log_prob_max_token_len_per_gpu": "verl's name; here actor.log_prob_micro_batch_tokens",
        "max_tokens_per_micro_batch": "here actor.micro_batch_tokens",
        "use_dynamic_bsz": "always on here: micro-batches are filled to actor.micro_batch_tokens",
        "ppo_micro_batch_size_per_gpu": "no fixed micro-batch size here: micro-batches are filled to "
                                        "actor.micro_batch_tokens",
    }
    policy_loss: str = "vanilla"
    """A verl policy loss (``vanilla`` = PPO-clip with asymmetric and dual clip, ``gspo``, ``cispo``, ...)."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step (× rollout.n samples), as in verl."""
    ppo_epochs: int = 1
    micro_batch_tokens: int = 4096
    """Token budget of one THD-packed micro-batch of the update pass (verl's ``use_dynamic_bsz`` with
    ``ppo_max_token_len_per_gpu``, counted per pack: under ``trainer.cp`` each rank holds 1/cp of it). A
    mini-batch's samples are balanced over the DP ranks and cut into the fewest micro-batches that fit
    (verl's ``rearrange_micro_batches``), the same number on every rank (``rl.train.micro_batch``); the loss is the
    same under any split. A sample is never split: one longer than the budget is refused."""
    log_prob_micro_batch_tokens: Optional[int] = None
    """The budget of the forward-only passes (old / reference log-probs, critic values), which keep no
    activations for a backward, so it can be larger (verl's ``log_prob_max_token_len_per_gpu``); null:
    ``micro_batch_tokens``."""
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    overlap_grad_reduce: bool = False
    """Megatron DDP's ``overlap_grad_reduce`` (``glm5_mcore.training.loop.OptimCfg``, SFT's ``optim``)."""
    overlap_param_gather: bool = False
    """Megatron DDP's ``overlap_param_gather`` (as SFT's ``optim``; the distributed optimizer, i.e. CUDA and
    DP > 1): saves and adapter pushes sync the parameters first."""
    mtp_loss_scale: float = 0.0
    """> 0: build the MTP block and train it (LoRA on its linears) on the rollout sequences beside the
    PPO loss, so the speculative-decoding draft head follows the policy (as the SFT recipe's
    ``train.mtp_loss_scale``); logs ``mtp/loss`` and ``rollout/mtp_accept``."""
    mtp_accept: bool = False
    """With the MTP loss off: still build the stored MTP block (forward only, adapters frozen) to log
    ``rollout/mtp_accept`` — how far the draft head falls behind the moving policy."""


@dataclass
class CriticCfg:
    lora: LoRACfg = field(default_factory=LoRACfg)
    cliprange_value: float = 0.5
    vf_coef: float = 1.0
    """The critic (value head + its own adapter "critic") trains in the same optimizer step as the
    actor; its loss is weighted by ``vf_coef`` (gradients are disjoint: separate adapters)."""


@dataclass
class TrainerCfg:
    steps: int = 60
    out: str = "runs/rl"
    world_size: int = 1
    """Trainer ranks (Ray actors forming one torch.distributed group)."""
    tp: int = 1
    ep: int = 1
    cp: int = 1
    """Context parallelism: each packed micro-batch split over ``cp`` ranks (per-document load-balanced
    chunks, as ``glm5 sft parallel.cp``); tp × cp must divide ``world_size``."""
    gpus_per_rank: float = 0.0
    """GPUs Ray gives each trainer rank; ``backend=te`` and ``bf16`` need 1."""
    etp: int = 1
    """Expert tensor parallelism (Megatron's ``expert_tensor_parallel_size``); etp × ep divides ``world_size``."""
    make_vocab_size_divisible_by: int = 1
    """The embedding and output layer padded to a multiple of this × tp (Megatron-LM's flag; as SFT's
    ``parallel.make_vocab_size_divisible_by``); the padded logits are -inf, the adapter pushed never holds them."""
    recompute: Optional[str] = None
    """null, ``selective`` or ``full``: Megatron's activation recompute (``glm5_mcore.mcore_settings.recompute_overrides``); CPU and GPU."""
    backend: str = "local"
    """Megatron-Core modules: ``local`` (CPU and GPU) or ``te`` (Transformer Engine, GPU)."""
    bf16: bool = False
    save_every: int = 0
    keep_last: int = 2
    eval_every: int = 10
    seed: int = 1234
    resume: bool = True
    allow_resume_mismatch: bool = False
    """Resume even if data, batch sizes, LoRA or model settings differ from the run's."""
    freeze_indexer: bool = True
    """Always true: RL keeps the DSA indexer frozen (no indexer loss runs here, and its top-k must stay the
    rollout engine's); the indexer learns in the SFT sparse stage (``glm5 sft train.freeze_indexer=false``)."""
    progress: bool = True
    stop_at_reward: Optional[float] = None
    """End the run early once the held-out reward reaches this value."""
    off_policy_steps: int = 0
    """1: one-step-off-policy (verl's recipe of that name): the engines generate step n+1's batch with the
    previous adapter while the trainer updates on step n; the trainer's old log-probs and IcePop / TIS
    correct the staleness. 0: synchronous."""
    max_staleness: int = 0
    """K >= 1: fully asynchronous (``rl.schedule.async_source``): the engines generate without pause; a prompt group
    is admitted while the samples ahead of it (unfinished, or complete and not trained) are at most K steps' worth,
    so a group of typical lengths is trained within K adapter versions; the trainer takes a step's batch as soon as
    that many groups are complete. Nothing is dropped for staleness: a long response that outlives K versions is
    trained with each token's behaviour log-prob (``rollout/over_staleness_samples``). 0: ``off_policy_steps``
    decides (today's loop)."""
    partial_rollout: bool = True
    """With ``max_staleness``: a weight push interrupts the requests in flight at a token boundary and
    continues them under the new adapter (each token keeps its behaviour log-prob and version); false: they
    finish under the adapter they started with and the push waits for them."""

    def parallel(self) -> ParallelConfig:
        """The trainer ranks' Megatron layout (``glm5_mcore.mcore_settings.ParallelConfig``)."""
        return ParallelConfig(tp=self.tp, ep=self.ep, cp=self.cp, etp=self.etp,
                              make_vocab_size_divisible_by=self.make_vocab_size_divisible_by)


@dataclass
class RayCfg:
    address: Optional[str] = None
    """None: start Ray locally; "auto" or "ray://host:10001": join that cluster."""
    num_cpus: Optional[int] = None
    placement_strategy: str = "PACK"
    """The trainer's placement group (Ray's ``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``);
    colocated engines live in its bundles."""
    wait_timeout_s: float = 1800.0
    """Longest wait for the trainer ranks' placement group and the rollout engines' start-up (each wait
    says what it waits for every minute); past it the run stops naming what it asked and what the cluster has."""


@dataclass
class RLConfig:
    model: ModelCfg = field(default_factory=lambda: ModelCfg(hf_dir="runs/tiny"))
    lora: LoRACfg = field(default_factory=LoRACfg)
    data: DataCfg = field(default_factory=DataCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    reward: RewardCfg = field(default_factory=RewardCfg)
    algorithm: AlgorithmCfg = field(default_factory=AlgorithmCfg)
    actor: ActorCfg = field(default_factory=ActorCfg)
    critic: CriticCfg = field(default_factory=CriticCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    ray: RayCfg = field(default_factory=RayCfg)
    wandb: WandbCfg = field(default_factory=WandbCfg)
    plan: PlanCfg = field(default_factory=PlanCfg)

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @staticmethod
    def from_dict(d: Optional[dict]) -> "RLConfig":
        """From a plain dict (a resolved Hydra config); unknown keys, wrong types and ``???`` values are
        errors naming the field, then impossible settings (``validate``)."""
        out = build(RLConfig, d)
        validate(out)
        return out


def run_settings(c: RLConfig) -> dict:
    """What a resume must keep (``glm5_mcore.training.resume``): data, batch sizes, LoRA, model, layout."""
    d, t = c.data, c.trainer
    return {
        "data": {"train": file_fingerprint(d.train), "val": file_fingerprint(d.val), "toy_size": d.toy_size,
                 "prompts_per_step": d.prompts_per_step, "seed": d.seed,
                 **({"columns": dict(d.columns)} if d.columns else {})},  # other columns: other prompts
        "rollout": {"n": c.rollout.n},
        "actor": {"ppo_mini_batch_size": c.actor.ppo_mini_batch_size,
                  **({"mtp": True} if c.actor.mtp_loss_scale > 0 else {})},  # MTP adapters exist or not
        "lora": {"rank": c.lora.rank, "alpha": c.lora.alpha, "targets": sorted(c.lora.targets)},
        "critic": ({"rank": c.critic.lora.rank, "alpha": c.critic.lora.alpha,
                    "targets": sorted(c.critic.lora.targets)} if c.use_critic else None),
        "model": model_fingerprint(c.model.hf_dir, c.model.ckpt),
        "layout": {"world_size": t.world_size, "tp": t.tp, "ep": t.ep, **({"etp": t.etp} if t.etp > 1 else {})},
        **({"async": {"max_staleness": t.max_staleness, "partial_rollout": t.partial_rollout}}
           if t.max_staleness else {}),  # the saved buffer of prompt groups and its seeds follow these
    }
