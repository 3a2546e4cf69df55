"""Issue 34 (classes 12, 13): RL settings and inputs that used to fail inside a Ray actor (a
``ray::Actor.method()`` stack at the first update or generate) or to be accepted silently are refused
before Ray starts, each with one line naming the field, file or setting, and nothing written."""

import json

import pytest

from recipes.main import main


def _d(tiny_dir, out, **sections) -> dict:
    d = {"model": {"hf_dir": str(tiny_dir)}, "wandb": {"mode": "disabled"},
         "data": {"prompts_per_step": 4, "val": None},
         "rollout": {"n": 2, "max_new_tokens": 4, "num_actors": 1},
         "actor": {"ppo_mini_batch_size": 4},
         "trainer": {"out": str(out), "progress": False, "eval_every": 0, "steps": 1}}
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return d


CODE_TOOL = {"enable": True, "env": "rl.tasks.code_env.python_tool", "tool_call_stop_tokens": ["<|observation|>"]}


@pytest.mark.parametrize("sections,msg", [
    ({"actor": {"policy_loss": "vanila"}}, "actor.policy_loss='vanila': not a verl policy loss; one of ["),
    ({"algorithm": {"router_replay": True},
      "rollout": {"multi_turn": {"enable": True, "tool_call_stop_tokens": [5]}}},
     "algorithm.router_replay=true with rollout.multi_turn.enable=true"),
    ({"reward": {"overlong_buffer": {"enable": True, "len": 2, "penalty_factor": -1.0}}},
     "reward.overlong_buffer.penalty_factor=-1.0 must be >= 0"),
    ({"rollout": {"engine_kwargs": {"dtpye": "bfloat16"}}},
     "rollout.engine_kwargs: unknown key(s) ['dtpye'] for rl.rollout.hf_engine.HFRolloutEngine; known: ['dtype', "),
    ({"rollout": {"engine_kwargs": {"dtype": "float64x"}}},
     "rollout.engine_kwargs.dtype='float64x': one of ('float32', 'bfloat16', 'float16')"),
    *[({"rollout": {"multi_turn": {**CODE_TOOL, "env_kwargs": kw}}}, msg) for kw, msg in [
        ({"wall_s": -1}, "rollout.multi_turn.env_kwargs.wall_s=-1: must be finite and > 0.0"),
        ({"memory_mb": 0}, "rollout.multi_turn.env_kwargs.memory_mb=0: must be >= 64"),
        ({"cpu_s": 0}, "rollout.multi_turn.env_kwargs.cpu_s=0: must be finite and > 0.0"),
        ({"max_output_bytes": -5}, "rollout.multi_turn.env_kwargs.max_output_bytes=-5: must be >= 1"),
        ({"cpu_secs": 5}, "rollout.multi_turn.env_kwargs: unknown sandbox limit(s) ['cpu_secs']; the limits are ["),
        ({"processes": 2.5}, "rollout.multi_turn.env_kwargs.processes=2.5: expected an integer"),
        ({"wall_s": 90}, "rollout.multi_turn.tool_timeout_s=60 must exceed env_kwargs.wall_s=90")]],
    ({"reward": {"error_score": float("nan")}}, "reward.error_score=nan: must be a finite number"),
    ({"reward": {"timeout_score": float("inf")}}, "reward.timeout_score=inf: must be a finite number"),
    ({"reward": {"timeout_s": float("inf")}}, "reward.timeout_s=inf: a timeout must be a finite number of seconds > 0"),
    ({"reward": {"timeout_s": float("nan")}}, "reward.timeout_s=nan: a timeout must be a finite number"),
    ({"reward": {"max_error_fraction": 0.0}}, "reward.max_error_fraction=0.0: must be in (0, 1]"),
    ({"rollout": {"multi_turn": {**CODE_TOOL, "tool_timeout_s": float("inf")}}},
     "rollout.multi_turn.tool_timeout_s=inf: a timeout must be a finite number"),
    ({"ray": {"wait_timeout_s": float("nan")}}, "ray.wait_timeout_s=nan: a timeout must be a finite number"),
    ({"rollout": {"routes_inline_bytes": -1}}, "rollout.routes_inline_bytes=-1: bytes >= 0"),
    ({"rollout": {"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine",
                  "engine_kwargs": {"enable_expert_parallel": True, "all2all_backend": "deepep_high_throughput"}},
      "lora": {"targets": ["linear_proj", "experts.linear_fc1"]}},
     "rollout.engine_kwargs.all2all_backend='deepep_high_throughput': vLLM serves routed-expert LoRA under expert "
     "parallelism only"),
    ({"rollout": {"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine", "engine_kwargs": {"max_lora_rank": 8}}},
     "rollout.engine_kwargs.max_lora_rank=8 is below the adapter's rank 16"),
    ({"rollout": {"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine", "engine_kwargs": {},
                  "colocate": {"enable": True, "sleep_level": 2}}},
     "rollout.colocate.sleep_level=2 with vLLM's LoRA mode"),
])
def test_config_refusals_name_the_field(tiny_dir, tmp_path, sections, msg):
    """Was: the typo found at the first update; R3 + tool episodes run; a negative factor rewarded overlong
    answers; an unknown engine key ignored; a bad dtype restarted the engine actor until it gave up. Issue
    42: sandbox limits that make every call fail (``memory_mb=0``: 32 failed calls, ``tool/errors`` 0), a
    typo a TypeError per call, a NaN / inf score skipping every update with exit 0, an infinite timeout a
    raw ``OverflowError`` after Ray started."""
    from rl.config import RLConfig

    with pytest.raises(ValueError) as e:
        RLConfig.from_dict(_d(tiny_dir, tmp_path / "rl", **sections))
    assert msg in str(e.value), str(e.value)


def _prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("case", ["stop_string", "stop_id", "context", "micro_batch", "micro_batch_cp", "mtp_accept",
                                  "ground_truth"])
def test_preflight_refusals_before_ray(tiny_dir, tmp_path, case):
    """Was: an unknown stop string found at the first generate, a stop id past the vocabulary sampled
    against, the engine's "exceeds max_position_embeddings" inside the actor (no file:line),
    ``mtp_accept`` on a model without MTP weights logging nothing, rows without ``ground_truth`` scored 0,
    a prompt + response longer than a micro-batch packed past the budget, or one that fits only before the
    trainer pads it for the CP split (34 tokens, 36 at CP 2: refused by the trainer's first update)."""
    import ray

    from rl.config import RLConfig
    from rl.driver import run

    rows = [{"prompt": "w1 w2 w3", "ground_truth": 1} for _ in range(4)]
    sections, msg = {}, ""
    if case == "stop_string":
        sections, msg = {"rollout": {"stop_token_ids": ["<|nope|>"]}}, \
            "rollout.stop_token_ids: '<|nope|>' is not a token of the tokenizer"
    elif case == "stop_id":
        sections, msg = {"rollout": {"stop_token_ids": [1, 128]}}, \
            "rollout.stop_token_ids: id 128 is outside the vocabulary [0, 128)"
    elif case == "context":
        rows[2] = {"prompt": " ".join(["w1"] * 509), "ground_truth": 0}
        sections = {"data": {"max_prompt_tokens": 1024}, "rollout": {"max_new_tokens": 4}}
        msg = "data.train: {train}:3 has 509 tokens; + rollout.max_new_tokens=4 exceeds the model's context " \
              "(max_position_embeddings=512)"
    elif case == "micro_batch":
        rows[2] = {"prompt": " ".join(["w1"] * 30), "ground_truth": 0}
        sections = {"actor": {"ppo_mini_batch_size": 4, "micro_batch_tokens": 4096, "log_prob_micro_batch_tokens": 32}}
        msg = "actor.log_prob_micro_batch_tokens=32: data.train: {train}:3 has 30 tokens; + rollout.max_new_tokens=4 " \
              "= 34 would not fit one micro-batch (a sample is never split)"
    elif case == "micro_batch_cp":
        rows[2] = {"prompt": " ".join(["w1"] * 30), "ground_truth": 0}
        sections = {"actor": {"ppo_mini_batch_size": 4, "micro_batch_tokens": 34},
                    "trainer": {"world_size": 2, "cp": 2}}
        msg = "actor.micro_batch_tokens=34: data.train: {train}:3 has 30 tokens; + rollout.max_new_tokens=4 " \
              "= 34, padded to 36 for the trainer.cp=2 split would not fit one micro-batch"
    elif case == "mtp_accept":
        sections, msg = {"actor": {"mtp_accept": True}}, \
            f"actor.mtp_accept=true: {tiny_dir} stores no MTP layer weights"
    else:
        rows[1] = {"prompt": "w4 w5"}
        msg = "{train}:2: no 'ground_truth' (or 'answer') field"
    train = _prompts(tmp_path / "train.jsonl", rows)
    d = _d(tiny_dir, tmp_path / "rl", **sections)
    d["data"]["train"] = train
    with pytest.raises(ValueError) as e:
        run(RLConfig.from_dict(d))
    assert msg.format(train=train) in str(e.value), str(e.value)
    assert not (tmp_path / "rl").exists() and not ray.is_initialized()


def test_cli_refusal_is_one_line_exit_2(tiny_dir, tmp_path, capsys):
    out = tmp_path / "rl"
    rc = main(["rl", f"model.hf_dir={tiny_dir}", f"trainer.out={out}", "rollout.stop_token_ids=[1,999]",
               "wandb=disabled"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "glm5 rl: error: rollout.stop_token_ids: id 999 is outside the vocabulary [0, 128)\n"
    assert not out.exists()


def test_nonfinite_rollout_logprobs_are_counted_masked_or_refused():
    """Issue 34 class 12: an engine returning NaN log-probs ran with rc 0, IcePop masking 100 %, nothing
    trained, no word. Some NaN: counted and out of the loss; all NaN: one line naming the engine."""
    import torch

    from rl.train.batch import RolloutBatch
    from rl.validate import rollout_logprob_check

    nan = float("nan")
    b = RolloutBatch.build([[5], [5]], [[7, 8], [9]], [[-1.0, nan], [-2.0]], [0, 0])
    m = rollout_logprob_check(b, 3, "my.Engine")
    assert m == {"rollout/nonfinite_logprob_fraction": pytest.approx(1 / 3)}
    assert b.response_mask.tolist() == [[1.0, 0.0], [1.0, 0.0]] and torch.isfinite(b.rollout_log_probs).all()
    b = RolloutBatch.build([[5]], [[7, 8]], [[nan, float("inf")]], [0])
    with pytest.raises(ValueError, match=r"rollout.engine=my.Engine: step 3: every one of the 2 response tokens "
                                         r"has a non-finite \(NaN / inf\) log-prob"):
        rollout_logprob_check(b, 3, "my.Engine")


def test_tp_not_dividing_the_vocabulary_passes_the_checks_before_ray(tiny_dir, tmp_path):
    """Issue 34 class 16 refused a vocabulary of 99 at TP 2 (``trainer.tp: vocab_size=99 is not divisible by
    tp=2``); issue 43 pads it as Megatron-LM does (``glm5_mcore.model.vocab``), so the checks before Ray pass
    and the trainer's layout builds 100 rows (``tests/layouts``: TP 2 on an odd vocabulary equals one rank)."""
    import shutil

    from transformers import AutoTokenizer

    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import padded_vocab_size
    from rl.config import RLConfig
    from rl.validate import preflight

    hf = tmp_path / "v99"
    shutil.copytree(tiny_dir, hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "vocab_size": 99}))
    c = RLConfig.from_dict(_d(hf, tmp_path / "rl", trainer={"world_size": 2, "tp": 2}))
    assert preflight(c, AutoTokenizer.from_pretrained(hf), {}) == (1,)  # eos
    c.trainer.parallel().validate(GLM5Config.from_hf_dir(hf))
    assert padded_vocab_size(99, c.trainer.tp, c.trainer.make_vocab_size_divisible_by) == 100
    assert not (tmp_path / "rl").exists()


def test_an_actor_whose_process_died_says_why_in_one_line():
    """Ray's reason for a system death (the memory monitor here) stays in the one line, not only its
    "died unexpectedly" headline."""
    import ray
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    from rl.cluster.ray_jobs import cause_line

    why = ("The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY "
           "Worker exit detail: Task was killed due to the node running low on memory.")
    e = ray.exceptions.ActorDiedError(ActorDiedErrorContext(class_name="TrainerActor", actor_id=b"\1" * 16, pid=12,
                                                            node_ip_address="127.0.0.1", error_message=why))
    line = cause_line(e)
    assert "\n" not in line and "NODE_OUT_OF_MEMORY" in line and "running low on memory" in line
    assert "actor_id" not in line
