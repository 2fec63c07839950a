"""The GPU recipes (examples/qwen_swe, qwen_terminal, qwen3_swe, qwen3_moe; the seed paper's layout: paper_qwen3_5_27b,
paper_glm4_7_flash) on CPU: what can be checked without a GPU.

- each config.yaml parses into the frozen TrainConfig and passes its validation (FP8 / Transformer Engine are only
  needed when the model is built, never by parsing), alone and with the flags slurm/train_grpo.sh adds;
- the README's sbatch variables agree with the config file (the script's flags override the file);
- the JSONL task module loads through ``--task module:name`` and its sample problems' reference solutions score 1.0
  with the unit_tests verifier (wrong ones 0.0);
- the bucket-memory figures the READMEs quote.
"""

import asyncio
import json
import os
import re

import pytest

from megatron_tsync.arguments import parse_args
from megatron_tsync.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"qwen_swe": dict(tp=4, pp=1, world=16, nodes=4, task="swe-jsonl"),
           "qwen_terminal": dict(tp=4, pp=2, world=16, nodes=4, task="terminal-jsonl"),
           "qwen3_swe": dict(tp=4, pp=1, world=16, nodes=4, task="swe-jsonl"),
           # TP 1 × PP 4, EP 8 (examples/qwen3_moe/README.md)
           "qwen3_moe": dict(tp=1, pp=4, ep=8, world=32, nodes=6, task="terminal-jsonl")}
# Public Hugging Face config.json values of the two policies (the parts the model builder reads).
HF_CONFIGS = {
    "qwen_swe": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                 "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                 "rms_norm_eps": 1e-06},
    "qwen_terminal": {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
                      "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                      "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                      "rms_norm_eps": 1e-06},
}
# sbatch variable -> (TrainConfig path, how the config value reads)
SBATCH_VARS = {"TP": "parallel.tensor_model_parallel_size", "PP": "parallel.pipeline_model_parallel_size",
               "GROUP_SIZE": "rl.group_size", "RL_MODE": "learner.mode", "ROLLOUT_ENGINE": "rollout.engine",
               "ROLLOUT_WORKERS": "rollout.num_workers", "SEQ_LENGTH": "rl.seq_length", "MAX_TURNS": "rl.max_turns",
               "MAX_NEW_TOKENS": "rl.max_new_tokens", "TRAIN_ITERS": "rl.train_iters",
               "SAVE_INTERVAL": "checkpoint.save_interval"}


def _config(name):
    return os.path.join(ROOT, "examples", name, "config.yaml")


def _get(cfg, path):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_parses_and_validates(name):
    r = RECIPES[name]
    cfg = parse_args(["--config", _config(name)], world_size=r["world"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.parallel.expert_model_parallel_size == r.get("ep", 1) and cfg.model.moe_aux_loss_coeff == 0.0
    assert cfg.precision.bf16 and cfg.precision.fp8_format == "hybrid"
    assert cfg.learner.sequence_packing and cfg.learner.max_packed_tokens >= cfg.rl.seq_length
    assert cfg.parallel.use_distributed_optimizer and cfg.optim.use_distributed_optimizer
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (r["tp"], r["pp"])
    assert cfg.parallel.data_parallel_size(r["world"]) >= 2
    assert cfg.rollout.engine == "vllm" and cfg.learner.mode == "stream-trajectory"
    assert cfg.learner.reward_spec.kind == "bounded" and cfg.learner.max_open_groups >= 1
    assert cfg.rollout.task == f"examples.jsonl_tasks:{r['task']}"
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("name", list(RECIPES))
def test_readme_sbatch_matches_config(name):
    """The sbatch command of the README sets the script's variables to the config file's values, and the command
    line that slurm/common.sh builds from them (flags after --config) parses to the same configuration."""
    r = RECIPES[name]
    text = open(os.path.join(ROOT, "examples", name, "README.md")).read()
    block = text[text.index(f"sbatch --nodes={r['nodes']} --gpus-per-node"):]
    block = block[: block.index("slurm/train_grpo.sh")].replace("\\\n", "")
    env = dict(re.findall(r"([A-Z_]+)=([^,\s\"]+)", block))
    assert f"--config examples/{name}/config.yaml" in block
    cfg = parse_args(["--config", _config(name)], world_size=r["world"])
    for var, path in SBATCH_VARS.items():
        assert var in env, var
        assert str(_get(cfg, path)) == env[var], (var, env[var], _get(cfg, path))
    assert int(env["GLOBAL_BATCH_SIZE"]) == cfg.rl.sequences_per_step
    assert int(env["TRAINER_NODES"]) * int(env["GPUS_PER_NODE"]) == r["world"]
    assert int(env["TRAINER_NODES"]) + int(env["ROLLOUT_NODES"]) == r["nodes"]
    documented = open(os.path.join(ROOT, "slurm", "common.sh")).read()
    for var in env:
        if var not in ("MODEL", "SAVE"):
            assert re.search(rf"\${{{var}\b|\b{var}=", documented), f"{var} is not read by slurm/common.sh"
    argv = ["--config", _config(name), "--model", "/m", "--rl-algorithm", "grpo", "--rl-mode", env["RL_MODE"],
            "--tensor-model-parallel-size", env["TP"], "--pipeline-model-parallel-size", env["PP"],
            "--train-iters", env["TRAIN_ITERS"], "--group-size", env["GROUP_SIZE"],
            "--global-batch-size", env["GLOBAL_BATCH_SIZE"], "--rollout-engine", env["ROLLOUT_ENGINE"],
            "--rollout-endpoint", "tcp://head:20001", "--secret-file", "/s/secret.hex", "--save", "/ck",
            "--save-interval", env["SAVE_INTERVAL"], "--load", "/ck", "--tensorboard-dir", "/ck/tb", "--no-progress",
            "--rollout-workers", env["ROLLOUT_WORKERS"], "--rollout-launch", "external", "--rollout-dir", "/ck/rp",
            "--seq-length", env["SEQ_LENGTH"], "--max-turns", env["MAX_TURNS"],
            "--max-new-tokens", env["MAX_NEW_TOKENS"]]
    full = parse_args(argv, world_size=r["world"])
    assert full.learner == cfg.learner and full.parallel == cfg.parallel and full.precision == cfg.precision


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_task_and_verifier(name, monkeypatch):
    from megatron_tsync.rollout.verifiers import get_verifier
    from megatron_tsync.runtime.tasks import get_task

    monkeypatch.setenv("TSYNC_TASK_FILE", os.path.join(ROOT, "examples", name, "sample_tasks.jsonl"))
    cfg = parse_args(["--config", _config(name)], world_size=RECIPES[name]["world"])
    task = get_task(cfg.rollout.task, verifier=cfg.rollout.verifier)
    assert task.reward_spec == cfg.learner.reward_spec
    a, b = task.sample_prompts(3, 4, seed=7), task.sample_prompts(3, 4, seed=7)
    assert [i.meta["id"] for i in a] == [i.meta["id"] for i in b]  # deterministic in (step, group, seed)
    assert a[0].prompt_text.startswith("<|im_start|>system")
    verifier = get_verifier(task.verifier, **task.verifier_kwargs)
    for rec in task.records("train")[:2]:
        inst = task.instance(rec)
        answer = task.demonstration(inst)[len(inst.prompt_text):]
        good = asyncio.run(verifier.evaluate(answer, inst.verifier_task()))
        bad = asyncio.run(verifier.evaluate("<answer>\n```\nexit 1\n```\n</answer>", inst.verifier_task()))
        assert good.reward == 1.0, (rec["id"], good)
        assert bad.reward == 0.0, (rec["id"], bad)


def _hf_config(name):
    path = os.path.join(ROOT, "examples", name, "config.json")  # the Qwen3 recipes ship their policy's config.json
    return json.load(open(path)) if os.path.exists(path) else HF_CONFIGS[name]


# (recipe, estimator, k = --max-open-groups, device vectors (--max-device-buckets or all), GiB per vector, GiB of all
#  k open groups' vectors, GiB of the device-resident ones, published size in B)
BUCKET_FIGURES = [("qwen_swe", "dr_grpo", 8, None, 7.1, 56.7, 56.7, 7.62),
                  ("qwen_terminal", "grpo", 3, None, 6.9, 41.3, 41.3, 14.77),
                  ("qwen3_swe", "dr_grpo", 8, 6, 7.6, 61.0, 45.8, 8.19),
                  ("qwen3_moe", "dr_grpo", 4, 2, 5.4, 21.6, 10.8, 30.53)]


@pytest.mark.parametrize("name,estimator,k,device,vector_gib,bucket_gib,device_gib,size", BUCKET_FIGURES)
def test_bucket_memory_figures(name, estimator, k, device, vector_gib, bucket_gib, device_gib, size):
    from examples.bucket_memory import estimate, params_per_rank

    from megatron_tsync.model.builder import ModelArch

    arch = ModelArch.from_hf_config(_hf_config(name))
    total = params_per_rank(arch, 1, 1)
    assert abs(total / 1e9 - size) < 0.01  # the published sizes
    cfg = parse_args(["--config", _config(name)], world_size=RECIPES[name]["world"])
    assert cfg.learner.estimator == estimator and cfg.learner.max_open_groups == k
    assert cfg.learner.max_device_buckets == device
    ep = cfg.parallel.expert_model_parallel_size
    e = estimate(arch, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size, estimator, k,
                 ep=ep)
    assert round(e["vector_bytes"] / 2**30, 1) == vector_gib
    assert round(e["bucket_bytes"] / 2**30, 1) == bucket_gib
    on_device = min(device or e["bucket_vectors"], e["bucket_vectors"]) * e["vector_bytes"]
    assert round(on_device / 2**30, 1) == device_gib
    readme = open(os.path.join(ROOT, "examples", name, "README.md")).read()
    for figure in {vector_gib, bucket_gib, device_gib}:
        assert f"{figure} GiB" in readme, (name, figure)


def test_qwen3_moe_without_expert_parallelism_figure():
    """The EP 1 alternative the MoE README quotes (TP 1 × PP 16: all 128 experts of 3 layers per rank), and that the
    recipe's EP 8 divides its experts and each stage's data-parallel ranks."""
    from examples.bucket_memory import params_per_rank

    from megatron_tsync.model.builder import ModelArch

    arch = ModelArch.from_hf_config(_hf_config("qwen3_moe"))
    n = params_per_rank(arch, 1, 16, 1)
    readme = open(os.path.join(ROOT, "examples", "qwen3_moe", "README.md")).read()
    assert f"{n / 1e9:.2f} B parameters per end-stage rank" in readme
    assert f"{4 * n / 2**30:.1f} GiB per vector" in readme
    cfg = parse_args(["--config", _config("qwen3_moe")], world_size=32)
    ep = cfg.parallel.expert_model_parallel_size
    assert arch.num_experts % ep == 0 and cfg.parallel.data_parallel_size(32) % ep == 0


@pytest.mark.parametrize("name,family", [("tiny_agent", "llama"), ("tiny_qwen3", "qwen3"),
                                         ("tiny_qwen3_moe", "qwen3_moe")])
def test_cpu_recipes_differ_from_the_quickstart_only_in_the_family_and_folders(name, family):
    """The CPU recipes of each family (examples/tiny_*) are the quickstart's run on another family: same task, RL and
    evaluation settings but one minibatch per step, their own model and checkpoint folders (README.md there has the
    measured runs)."""
    cfg = parse_args(["--config", _config(name)], world_size=1)
    base = parse_args(["--config", _config("tiny_agent")], world_size=1)
    assert cfg.model.init_tiny_model and cfg.model.tiny_model_family == family
    assert cfg.model.path == f"runs/{name}/model" and cfg.checkpoint.save == f"runs/{name}/ckpt"
    def same(c):  # one optimizer step per batch for the Qwen3 ones (their README.md says why)
        d = {k: v for k, v in c.to_dict().items() if k not in ("model", "checkpoint")}
        d["learner"] = {k: v for k, v in d["learner"].items() if k != "num_minibatches"}
        return d

    assert same(cfg) == same(base)
    assert cfg.learner.num_minibatches == (2 if name == "tiny_agent" else 1)


def test_tau2_recipe_parses_and_names_tau2s_tasks(monkeypatch):
    """examples/tau2_qwen3_8b: the config parses for its 8 trainer GPUs, its README's sbatch variables match it, and
    its task is τ²'s airline + retail with the Qwen tool format and τ²'s LLM user (docs/tau2.md)."""
    pytest.importorskip("tau2", reason="the optional tau2 extra is not installed")
    from megatron_tsync.runtime.tasks import get_task

    cfg = parse_args(["--config", _config("tau2_qwen3_8b")], world_size=8)
    assert cfg.rollout.engine == "vllm" and cfg.learner.mode == "stream-trajectory"
    assert cfg.learner.max_packed_tokens >= cfg.rl.seq_length and cfg.parallel.data_parallel_size(8) == 2
    text = open(os.path.join(ROOT, "examples", "tau2_qwen3_8b", "README.md")).read()
    block = text[text.index("sbatch --nodes=2"):]
    env = dict(re.findall(r"([A-Z_]+)=([^,\s\"]+)", block[: block.index("slurm/train_grpo.sh")].replace("\\\n", "")))
    for var, path in SBATCH_VARS.items():
        assert str(_get(cfg, path)) == env[var], (var, env[var], _get(cfg, path))
    assert int(env["GLOBAL_BATCH_SIZE"]) == cfg.rl.sequences_per_step
    monkeypatch.setenv("TSYNC_TAU2_TOOL_FORMAT", "qwen")
    monkeypatch.setenv("TSYNC_TAU2_USER_LLM", "openai/user")
    monkeypatch.setenv("TSYNC_TAU2_USER_API_BASE", "http://usernode:8000/v1")
    task = get_task(cfg.rollout.task, verifier=cfg.rollout.verifier)
    assert task.domains == ("airline", "retail") and task.user_mode == "llm" and task.tool_stop_text == "</tool_call>"
    assert task.reward_spec == cfg.learner.reward_spec and not task.keep_trivial_tasks
    # τ²'s test splits (20 airline + 40 retail) less the tasks a do-nothing conversation solves (6 + 2: the slow
    # tests/runtime/test_tau2_tasks.py::test_do_nothing_solvable_tasks_of_airline_and_retail checks the list)
    from tests.runtime.test_tau2_tasks import DO_NOTHING_SOLVED

    full = get_task(cfg.rollout.task, verifier=cfg.rollout.verifier, keep_trivial_tasks=True)
    solved = DO_NOTHING_SOLVED[("airline", "test")] | DO_NOTHING_SOLVED[("retail", "test")]
    assert len(full.pool("eval")) == 60 and 60 - len(solved) == 52 == cfg.logging.eval_prompts


# ------------------------------------------------------------------------- the seed paper's layout (examples/paper_*)
# One 8-GPU node: 4 trainer ranks (GPUs 0-3) + 4 vLLM engines (GPUs 4-7), 32 prompts x 8, up to 300 turns, GRPO with
# the accumulators in host memory. Figures: the README's memory table (GiB, one decimal), from the model's shape.
PAPER = {"paper_qwen3_5_27b": dict(model="qwen3.5-27b", tp=4, ep=1, seq=32768, host=326, total=154),
         "paper_glm4_7_flash": dict(model="glm-4.7-flash", tp=1, ep=4, seq=16384, host=441, total=163)}


def _sbatch_env(name: str) -> tuple[str, dict]:
    text = open(os.path.join(ROOT, "examples", name, "README.md")).read()
    block = text[text.index("sbatch --nodes=1 --gpus-per-node"):]
    block = block[: block.index("slurm/train_grpo.sh")].replace("\\\n", "")
    return block, dict(re.findall(r"([A-Z_]+)=([^,\s\"]+)", block))


@pytest.mark.parametrize("name", list(PAPER))
def test_paper_recipe_parses_and_its_sbatch_command_agrees(name):
    """The config validates for 4 trainer ranks; the README's command puts them on half of one node, the engines on
    the other half, and sets the script's variables to the config's values (the flags it adds parse to the same
    learner, parallel and precision settings)."""
    r = PAPER[name]
    cfg = parse_args(["--config", _config(name)], world_size=4)
    assert cfg.learner.mode == "stream-trajectory" and cfg.learner.accumulate_on_host and cfg.learner.max_open_groups
    assert cfg.rl.group_size * 32 == cfg.rl.sequences_per_step == 256 and cfg.rl.max_turns == 300
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size) == (
        r["tp"], 1, r["ep"])
    assert p.data_parallel_size(4) == 4 // r["tp"] and cfg.rl.seq_length == r["seq"]
    assert cfg.rollout.engine == "vllm" and cfg.rollout.num_workers == 4
    block, env = _sbatch_env(name)
    assert f"--config examples/{name}/config.yaml" in block
    for var, path in SBATCH_VARS.items():
        assert str(_get(cfg, path)) == env[var], (var, env[var], _get(cfg, path))
    assert int(env["GLOBAL_BATCH_SIZE"]) == cfg.rl.sequences_per_step
    assert (env["TRAINER_NODES"], env["ROLLOUT_NODES"], env["GPUS_PER_NODE"], env["TRAINER_GPUS"]) == ("1", "0", "8", "4")
    assert int(env["GPUS_PER_NODE"]) - int(env["TRAINER_GPUS"]) == cfg.rollout.num_workers  # one GPU per engine
    argv = ["--config", _config(name), "--model", "/m", "--rl-mode", env["RL_MODE"],
            "--tensor-model-parallel-size", env["TP"], "--pipeline-model-parallel-size", env["PP"],
            "--seq-length", env["SEQ_LENGTH"], "--max-turns", env["MAX_TURNS"]]
    full = parse_args(argv, world_size=4)
    assert full.learner == cfg.learner and full.parallel == cfg.parallel and full.precision == cfg.precision


@pytest.mark.parametrize("name", list(PAPER))
def test_paper_recipe_memory_figures(name):
    """The README's memory table, recomputed: model state (bf16 weights, fp32 grad buffer, the distributed
    optimizer's fp32 master + Adam over the data-parallel copies of each parameter), no bucket on the GPU, the
    recomputation's layer inputs, one layer's activations and a trajectory's logits; the host bound 4(2k+1)P."""
    from megatron_tsync.plan.hardware import MODELS, load_arch
    from megatron_tsync.plan.memory import params_per_rank

    r = PAPER[name]
    cfg = parse_args(["--config", _config(name)], world_size=4)
    arch, gib = load_arch(r["model"]), 2**30
    tp, ep, dp, s = r["tp"], r["ep"], 4 // r["tp"], r["seq"]
    p, whole = params_per_rank(arch, tp, 1, ep), params_per_rank(arch, tp, 1, 1)
    shape, h, layers = MODELS[r["model"]], arch.hidden_size, arch.num_layers
    if name == "paper_qwen3_5_27b":  # TP splits every head count: query, KV, linear-attention key and value heads
        assert all(shape[k] % tp == 0 for k in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
                                                 "linear_num_value_heads"))
        vocab, layer = arch.vocab_size // tp, s * h * (10 + 24 // tp)
    else:  # EP splits the routed experts and the data-parallel ranks
        assert shape["n_routed_experts"] % ep == 0 and dp % ep == 0
        vocab = arch.vocab_size
        layer = s * (34 * h + 6 * shape["num_experts_per_tok"] * shape["moe_intermediate_size"])
    rows = [2 * p, 4 * p, 12 * whole / dp, 0, layers * s * h * 2, layer, s * vocab * 10]
    readme = open(os.path.join(ROOT, "examples", name, "README.md")).read()
    for row in rows:
        assert f"| {row / gib:.1f} |" in readme, (name, row / gib)
    assert round(sum(rows) / gib) == r["total"] and f"**≈ {r['total']}** of a B200's 180" in readme
    k = cfg.learner.max_open_groups
    assert round(4 * (2 * k + 1) * p / gib) == r["host"] and f"4(2k+1)P = **{r['host']} GiB**" in readme
