"""Qwen3 dense (QK-norm, head_dim ≠ hidden/heads, tied or untied) and Llama-3.x RoPE scaling, end to end.

- config parsing (Qwen3-4B, Llama-3.1/3.2 hub configs in both transformers formats) and the refusals;
- llama3 inverse frequencies bitwise equal to transformers' (megatron-core's own ``rope_scaling`` hard-codes three
  of the four constants: the control shows it differs when the config does);
- Megatron vs transformers logits, fp32, ≤ 1e-5 max abs: TP=1 in this process (with controls that must move: a
  perturbed q_layernorm, the plain RoPE frequencies) and TP=2 in one torchrun (gloo), which also checks the
  HF → Megatron → HF export bitwise at TP=2 and at PP=2;
- pure HF ⇄ Megatron round trips at every (TP, PP) ≤ 2; config.json round trip through transformers' classes;
- ``IncrementalGPT`` (chunked, KV kept) equals the full forward; the embedded engine's greedy generation is the
  argmax of the full forward and its log-probs are the trainer's;
- float64: streamed (stream-trajectory, stream-group) vs sync gradient ≤ 1e-12 relative.

Slow tier: ``tools/convert_checkpoint.py`` round trips at TP=2 and PP=2; TP=2 / PP=2 / DP=2 log-probs, gradient and
post-step weights equal one process's (tests/training's parallel-equivalence worker on a tiny Qwen3); the quickstart
config trained 2 steps with ``--model`` a tiny Qwen3 / Qwen3-MoE made by ``tools/make_tiny_model.py``.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model.builder import ModelArch

_spec = importlib.util.spec_from_file_location(
    "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

LOGIT_TOL = 1e-5
WORKER = os.path.join(common.WORKERS, "conv_logits_worker.py")
DRIVER = os.path.join(os.path.dirname(__file__), "_convert_driver.py")

QWEN3_4B = {  # config.json of Qwen/Qwen3-4B (transformers 4.51 format)
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02,
    "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA32_1B = {  # config.json of meta-llama/Llama-3.2-1B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64, "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "vocab_size": 128256,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return common.make_qwen3_models(str(tmp_path_factory.mktemp("tiny_qwen3")))


# ----------------------------------------------------------------------------------------------- configs, pure


def test_from_hf_config_qwen3_and_llama3():
    a = ModelArch.from_hf_config(QWEN3_4B)
    assert (a.family, a.hidden_size, a.num_attention_heads, a.num_kv_heads, a.head_dim) == ("qwen3", 2560, 32, 8, 128)
    assert a.head_dim != a.hidden_size // a.num_attention_heads
    assert a.qk_layernorm and not a.qkv_bias and a.tie_word_embeddings and a.rope_theta == 1e6
    assert a.rope_type == "default"
    for bias in ({"attention_bias": True}, {"mlp_bias": True}):  # o_proj / MLP biases: no megatron field
        with pytest.raises(ValueError, match="not supported"):
            ModelArch.from_hf_config({**QWEN3_4B, **bias})
        with pytest.raises(ValueError, match="not supported"):
            ModelArch.from_hf_config({**LLAMA32_1B, **bias})
    b = ModelArch.from_hf_config(LLAMA32_1B)
    assert (b.rope_type, b.rope_factor, b.rope_low_freq_factor, b.rope_high_freq_factor,
            b.rope_original_max_position_embeddings) == ("llama3", 32.0, 1.0, 4.0, 8192)
    assert not b.qk_layernorm and b.rope_theta == 5e5
    # transformers ≥ 5 writes rope_parameters (theta inside) instead of rope_scaling
    v5 = {k: v for k, v in LLAMA32_1B.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**LLAMA32_1B["rope_scaling"], "rope_theta": 500000.0}
    assert ModelArch.from_hf_config(v5) == b
    plain = {**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert ModelArch.from_hf_config(plain).rope_type == "default"


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                                     {"type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_other_rope_scaling_refused(scaling):
    with pytest.raises(ValueError, match="not supported"):
        ModelArch.from_hf_config({**LLAMA32_1B, "rope_scaling": scaling})


def test_qwen3_sliding_window_and_incomplete_llama3_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        ModelArch.from_hf_config({**QWEN3_4B, "use_sliding_window": True})
    with pytest.raises(ValueError, match="lacks"):
        ModelArch.from_hf_config({**LLAMA32_1B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("orig,low,high", [(8192, 1.0, 4.0), (64, 1.0, 4.0), (8192, 2.0, 8.0)])
def test_llama3_inv_freq_equals_transformers(orig, low, high):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_tsync.model import compat

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": orig}
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=500000.0, rope_scaling=scaling,
                      max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    mine = compat.llama3_inv_freq(128, 500000.0, factor=8.0, low_freq_factor=low, high_freq_factor=high,
                                  original_max_position_embeddings=orig)
    assert mine.dtype == torch.float32 and torch.equal(mine, ref)
    # megatron-core's rope_scaling=True only knows the factor (1, 4, 8192 hard-coded): equal only for those
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    mcore = RotaryEmbedding._apply_scaling(None, base, factor=8.0)
    assert torch.equal(mcore, ref) == ((orig, low, high) == (8192, 1.0, 4.0))


def _gather_pure(shards, pp_off, arch):
    full = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if name.endswith("linear_fc1.weight"):
            full[name] = parts
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            full[name] = torch.cat(parts, dim=1)
        elif name.endswith("norm.weight"):  # input/pre-MLP/final norms and q/k layernorms: replicated over TP
            assert all(torch.equal(parts[0], p) for p in parts), name
            full[name] = parts[0]
        else:
            full[name] = torch.cat(parts, dim=0)
    return hc.megatron_full_to_hf(full, arch, pp_off, len(shards))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "llama3"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_pure_round_trip(models, name, tp, pp):
    arch, state = hc.load_hf_dir(models[name])
    if arch.qk_layernorm:
        assert "model.layers.1.self_attn.q_norm.weight" in state and "model.layers.0.self_attn.k_norm.weight" in state
        shard = hc.hf_to_megatron(state, arch, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
        assert torch.equal(shard["decoder.layers.0.self_attention.k_layernorm.weight"],
                           state["model.layers.1.self_attn.k_norm.weight"])  # stage-local index, whole vector
    back = {}
    for p in range(pp):
        shards = [hc.hf_to_megatron(state, arch, tp_rank=r, tp_size=tp, pp_rank=p, pp_size=pp) for r in range(tp)]
        back.update(_gather_pure(shards, hc.stage_layers(arch, p, pp)[0], arch))
    assert sorted(back) == sorted(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "llama3"])
def test_config_round_trip_through_transformers(models, name, tmp_path):
    from transformers import AutoConfig

    arch, state = hc.load_hf_dir(models[name])
    hc.save_hf_dir(str(tmp_path / "out"), state, arch, tokenizer_src=models[name])
    cfg = AutoConfig.from_pretrained(str(tmp_path / "out"))
    assert ModelArch.from_hf_dir(str(tmp_path / "out")) == arch
    assert cfg.head_dim == arch.head_dim and cfg.tie_word_embeddings == arch.tie_word_embeddings
    if name.startswith("qwen3"):
        assert type(cfg).__name__ == "Qwen3Config" and arch.head_dim == 64 and arch.hidden_size // 4 == 32
    else:
        rp = cfg.rope_parameters
        assert rp["rope_type"] == "llama3" and rp["original_max_position_embeddings"] == 64
        with open(tmp_path / "out" / "config.json") as f:
            assert json.load(f)["rope_scaling"]["rope_type"] == "llama3"  # what vLLM / transformers < 5 read
    with pytest.raises(ValueError, match="qk_layernorm"):
        hc.hf_config_dict(dataclasses.replace(arch, qk_layernorm=not arch.qk_layernorm))
    with pytest.raises(ValueError, match="o_proj"):
        hc.hf_config_dict(dataclasses.replace(arch, qkv_bias=True))


# ------------------------------------------------------------------------------------- Megatron models, TP=1


def _hf_logits(path, ids):
    return hc.transformers_logits(path, ids)  # (B, S, V)


def _megatron(path, seed=1):
    from megatron_tsync.model.builder import build_model

    arch, state = hc.load_hf_dir(path)
    model = build_model(arch, seed=seed)
    hc.load_hf_into_model(model, state)
    model.eval()
    return model, arch, state


def _ids(vocab, rows=2, length=90, seed=0):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))  # (B, S)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "llama3"])
def test_logits_match_transformers_tp1_with_controls(megatron_single, models, name):
    from megatron_tsync.model.logprobs import model_logits

    model, arch, _ = _megatron(models[name])
    if arch.qk_layernorm:
        assert {"q_layernorm", "k_layernorm"} <= {n.split(".")[-2] for n, _ in model.named_parameters()}
    ids = _ids(arch.vocab_size)
    ref = _hf_logits(models[name], ids)
    with torch.no_grad():
        diff = (model_logits(model, ids) - ref).abs().max().item()
        print(f"{name} TP=1: max |logit diff| = {diff:.3g} (max |logit| {ref.abs().max().item():.3g})")
        assert diff <= LOGIT_TOL
        # controls: without the QK-norm weights / with megatron's plain RoPE frequencies the logits move
        if arch.qk_layernorm:
            model.decoder.layers[0].self_attention.k_layernorm.weight.mul_(1.05)
        else:
            from megatron_tsync.model import compat

            plain = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
            compat.set_rope_inv_freq(model, plain)
        moved = (model_logits(model, ids) - ref).abs().max().item()
    assert moved > 100 * LOGIT_TOL, moved


@pytest.mark.parametrize("name", ["qwen3_tied", "llama3"])
def test_incremental_forward_equals_full(megatron_single, models, name):
    from megatron_tsync.model.incremental import IncrementalGPT
    from megatron_tsync.model.logprobs import model_logits

    model, arch, _ = _megatron(models[name])
    ids = _ids(arch.vocab_size, rows=1, length=75, seed=1)[0]  # (S,)
    with torch.no_grad():
        full = model_logits(model, ids.unsqueeze(0))  # (1, S, V)
        inc = IncrementalGPT(model)
        hs = [inc.extend(ids[a:b], a) for a, b in ((0, 7), (7, 8), (8, 40), (40, 75))]  # (s, 1, h) each
        chunked = inc.head(torch.cat(hs))  # (1, S, V)
    diff = (chunked - full).abs().max().item()
    print(f"{name}: incremental vs full max |logit diff| = {diff:.3g}")
    assert diff <= LOGIT_TOL


def test_embedded_engine_greedy_is_full_forward_argmax(megatron_single, models):
    from megatron_tsync.model.logprobs import model_logits, token_logprobs
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig

    path = models["qwen3_tied"]
    engine = EmbeddedEngine.from_hf_dir(path)
    trainer, arch, _ = _megatron(path, seed=7)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(9, arch.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 30)]
    out = engine.generate(prompts, SamplingConfig(top_k=1, max_new_tokens=16, seed=0))
    worst = 0.0
    for p, (c,) in zip(prompts, out):
        assert len(c.token_ids) == 16
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logits = model_logits(trainer, ids)[0, len(p) - 1 : -1]  # (16, V)
            lp = token_logprobs(trainer, ids)[0, len(p) - 1 :]  # (16,)
        assert logits.argmax(-1).tolist() == c.token_ids
        worst = max(worst, (lp - torch.tensor(c.logprobs, dtype=lp.dtype)).abs().max().item())
    print(f"embedded engine vs trainer log-prob max |diff| = {worst:.3g}")
    assert worst <= LOGIT_TOL


# ------------------------------------------------------------------------------------------ float64 streaming

QWEN3_TINY64 = ModelArch(family="qwen3", vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                         num_attention_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e6, qk_layernorm=True)
LLAMA3_TINY64 = ModelArch(family="llama", vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                          num_attention_heads=4, num_kv_heads=2, head_dim=16, rope_theta=5e5, rope_type="llama3",
                          rope_factor=8.0, rope_original_max_position_embeddings=64)


@pytest.mark.parametrize("arch", [QWEN3_TINY64, dataclasses.replace(QWEN3_TINY64, tie_word_embeddings=True),
                                  LLAMA3_TINY64], ids=["qwen3", "qwen3_tied", "llama3"])
@pytest.mark.parametrize("estimator,aggregation", [("grpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum")])
def test_float64_streamed_equals_sync(megatron_single, arch, estimator, aggregation):
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from megatron_tsync.training.stream_fb import LossConfig
    from tests.training.stream_cases import arrival_order, make_samples, spec_for
    from tests.training.test_streaming_exactness import TOL, gradient, rel

    ddp = wrap_ddp(build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0))
    if arch.qk_layernorm:
        with torch.no_grad():  # non-trivial norm weights, so their gradients are not all alike
            for n, p in ddp.named_parameters():
                if "layernorm" in n:
                    p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n)), dtype=p.dtype))
    model64 = (ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)))
    samples = make_samples(11, reward_kind="bounded")
    kw = dict(estimator=estimator, reward_spec=spec_for("bounded"), loss=LossConfig(aggregation=aggregation))
    g_sync, _ = gradient(model64, "sync", samples, samples, **kw)
    assert g_sync.norm() > 0
    worst = 0.0
    for mode, seed in (("stream-trajectory", 1), ("stream-trajectory", 2), ("stream-group", 3)):
        g, _ = gradient(model64, mode, samples, arrival_order(samples, seed), **kw)
        worst = max(worst, rel(g, g_sync))
    print(f"{arch.family}/{arch.rope_type} tie={arch.tie_word_embeddings} {estimator} {aggregation}: "
          f"max relative |g_stream - g_sync| = {worst:.3g}")
    assert worst < TOL


# ------------------------------------------------------------------------------------------- multi-process


def _check_report(path, expect_layouts, names):
    with open(path) as f:
        rep = json.load(f)
    assert {(r["tp"], r["pp"]) for r in rep} == expect_layouts and len(rep) == len(expect_layouts) * len(names)
    for r in rep:
        assert r["same_keys"] and not r["mismatched"], r
        if r["pp"] == 1:
            print(f"{r['family']}/{r['rope_type']} tie={r['tie']} tp={r['tp']}: "
                  f"max |logit diff| = {r['max_abs_logit_diff']:.3g}")
            assert r["max_abs_logit_diff"] <= LOGIT_TOL, r
    return rep


@pytest.mark.slow  # two processes: the full suite
def test_logits_tp2_and_export_tp2_pp2(two_procs):
    """One torchrun (2 gloo processes): TP=2 logits vs transformers, and HF → Megatron → HF bitwise at TP=2 and
    PP=2, for the three tiny models (the tied Qwen3 is MQA 4/1: TP=2 splits its KV group). The worker runs in the
    two-process launch of ``two_procs`` (after the conversions)."""
    rep = _check_report(two_procs[1], {(2, 1), (1, 2)}, ["qwen3", "qwen3_tied", "llama3"])
    assert {r["qk_layernorm"] for r in rep} == {True, False}


@pytest.fixture(scope="module")
def two_procs(models, tmp_path_factory, request):
    """One torchrun of two gloo processes (tests/model/_convert_driver.py) for every two-process test here: each
    selected case of test_convert_checkpoint_bit_identical (the tool's main() under a launcher), each HF →
    Megatron save at its TP=2 or PP=2, then each export at TP = PP = 1 (the two ranks data-parallel; rank 0
    writes); then (when test_logits_tp2_and_export_tp2_pp2 is selected) conv_logits_worker.py on the three
    models. Returns ({(name, tp, pp): (checkpoint, exported HF folder)}, the worker's report or None)."""
    from ..training._launch import item_param, selected_params

    cases = selected_params(request, lambda item: (item_param(item, "name"), item_param(item, "tp"),
                                                   item_param(item, "pp"))
                            if item.name.startswith("test_convert_checkpoint_bit_identical") else None)
    d = tmp_path_factory.mktemp("qwen3_convert")
    out = {c: (str(d / "mcore-{}-{}-{}".format(*c)), str(d / "hf-{}-{}-{}".format(*c))) for c in cases}
    saves = [["--direction", "hf-to-megatron", "--load", models[n], "--save", out[(n, tp, pp)][0],
              "--target-tensor-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp)]
             for n, tp, pp in cases]
    exports = [["--direction", "megatron-to-hf", "--load", mc, "--save", dst] for mc, dst in out.values()]
    with open(d / "jobs.json", "w") as f:
        json.dump(saves + exports, f)
    rep = str(d / "rep.json")
    logits = bool(selected_params(request, lambda item: item.name == "test_logits_tp2_and_export_tp2_pp2" or None))
    then = ["--then", WORKER, "--hf", *(models[n] for n in ("qwen3", "qwen3_tied", "llama3")), "--out", rep] \
        if logits else []
    rc, log, _ = common.run_isolated([DRIVER, "--jobs", str(d / "jobs.json"), *then], nproc=2, timeout=600)
    assert rc == 0, log[-4000:]
    return out, (rep if logits else None)


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,pp", [("qwen3", 2, 1), ("qwen3_tied", 1, 2), ("llama3", 2, 1)])
def test_convert_checkpoint_bit_identical(models, two_procs, name, tp, pp):
    """HF → megatron (TP=2 or PP=2) → HF gives the same tensors and config. Llama 3 at TP=2 only: its own part is
    the rope-scaling config (checked here); the PP=2 split is the same code for every family (qwen3_tied here, llama
    in tests/tools/test_convert_checkpoint.py). The conversions of all cases run in one launch (``two_procs``)."""
    from megatron_tsync.training import checkpointing as ck

    src, (mc, dst) = models[name], two_procs[0][(name, tp, pp)]
    meta = ck.read_meta(mc)
    assert meta["layout"]["tp"] == tp and meta["layout"]["pp"] == pp
    assert ck.arch_from_checkpoint(mc) == ModelArch.from_hf_dir(src)  # qk_layernorm / rope fields survive the meta
    arch0, s0 = hc.load_hf_dir(src)
    arch1, s1 = hc.load_hf_dir(dst)
    assert arch0 == arch1 and sorted(s0) == sorted(s1)
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k
    with open(os.path.join(src, "config.json")) as a, open(os.path.join(dst, "config.json")) as b:
        assert json.load(a) == json.load(b)


# router replay with a shared prompt: a step's arrivals reach the learner together, every group trains
REPLAY_SHARED_PREFIX = ["--shared-prefix", "--stream-coalesce-tokens", "1000000", "--no-skip-zero-advantage"]


@pytest.mark.slow
@pytest.mark.parametrize("family, extra, replay", [("qwen3", ["--tie"], False), ("qwen3_moe", [], True),
                                                   ("qwen3.5", [], False)])
def test_quickstart_trains_tiny_qwen3(tmp_path, family, extra, replay):
    """The quickstart's config (examples/tiny_agent/config.yaml) with ``--model`` a tiny Qwen3 / Qwen3-MoE / Qwen3.5
    (Gated DeltaNet hybrid: the embedded engine keeps its linear layers' recurrent state) made by the tool; 2 RL
    steps, no warm start, 2 evaluation prompts (small batches: this checks that it runs, not that it
    learns: every assertion holds for an untrained model). With
    ``--moe-router-replay`` every trajectory of the live run arrives with the engine's routing (dumped), and with
    ``--shared-prefix`` (every arrival of a step coalesced, no zero-advantage skip) groups share their prompt. The MoE
    quickstart without replay runs in tests/runtime/test_deterministic_live.py's EP pair (at EP=2, --deterministic)."""
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    model = str(tmp_path / family)
    subprocess.run([sys.executable, os.path.join(common.REPO, "tools", "make_tiny_model.py"), "--out", model,
                    "--family", family, *extra], check=True, env=env, capture_output=True, timeout=300)
    assert ModelArch.from_hf_dir(model).qk_layernorm
    args = ["--config", os.path.join(common.REPO, "examples", "tiny_agent", "config.yaml"), "--model", model,
            "--save", str(tmp_path / "ck"), "--tensorboard-dir", str(tmp_path / "tb"), "--train-iters", "2",
            "--sft-warmup-steps", "0", "--group-size", "2", "--global-batch-size", "4", "--max-new-tokens", "16",
            "--no-progress", "--eval-prompts", "2"]
    if replay:
        args += ["--moe-router-replay", "--dump-rollouts", str(tmp_path / "dump"), *REPLAY_SHARED_PREFIX]
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert "summary: mode stream-trajectory, 2 steps" in p.stdout
    hist = json.loads((tmp_path / "ck" / "history.json").read_text())
    assert [h["step"] for h in hist] == [0, 1]
    # the quickstart's held-out evaluation on this family (the policy itself in the embedded engine): v0 and the end
    assert [e["version"] for e in json.loads((tmp_path / "ck" / "eval.json").read_text())] == [0, 2]
    from megatron_tsync.training import checkpointing as ck

    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert ck.arch_from_checkpoint(str(tmp_path / "ck")) == ModelArch.from_hf_dir(model)  # the Qwen3 was trained
    if replay:
        from megatron_tsync.runtime.rollout_io import load_rollouts

        arch = ModelArch.from_hf_dir(model)
        for step in (0, 1):
            samples, _ = load_rollouts(str(tmp_path / "dump"), step)
            assert len(samples) == 4
            for s in samples:  # routed by the engine at every position it computed, and trained on
                assert s.routing is not None and s.routing.shape[1:] == (arch.num_layers, arch.moe_router_topk)
                assert 0 < s.routing.shape[0] < s.token_ids.numel() and s.loss_mask.sum() > 0
        assert sum(h["plan_shared_prefix_items"] for h in hist) > 0 and "plan_shared_prefix_routing_split" in hist[0]


@pytest.mark.slow
def test_qwen3_tp2_pp2_dp2_match_single_process(models, tmp_path):
    """tests/training's parallel-equivalence worker on the tied MQA Qwen3: log-probs, gradient (HF names) and
    post-Adam-step weights of TP=2, PP=2 and DP=2 (one 2-process launch) equal one process's, with the same
    tolerances as for the dense Llama (1e-5), and per tensor for the q/k norms (whose gradient megatron's
    ``finalize_model_grads`` sums over TP: each TP rank sees only its own heads)."""
    from tests.training._launch import torchrun

    worker = os.path.join(common.WORKERS, "parallel_equiv_worker.py")
    d, model = tmp_path, models["qwen3_tied"]
    torchrun(worker, ["--model", model, "--out-dir", str(d), "--layouts", "single"], nproc=1)
    torchrun(worker, ["--model", model, "--out-dir", str(d), "--layouts", "tp2", "pp2", "dp2"], nproc=2)
    ref = torch.load(str(d / "single.pt"))

    def rel(a, b, keys):
        num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in keys) ** 0.5
        return num / sum(float(b[k].double().pow(2).sum()) for k in keys) ** 0.5

    qk = [k for k in ref["grads"] if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(qk) == 4 and all(ref["grads"][k].abs().max() > 0 for k in qk)
    for layout in ("tp2", "pp2", "dp2"):
        got = torch.load(str(d / f"{layout}.pt"))
        assert set(got["logprobs"]) == set(ref["logprobs"]) and set(got["grads"]) == set(ref["grads"])
        lp = max(float((got["logprobs"][k] - ref["logprobs"][k]).abs().max()) for k in ref["logprobs"])
        g = rel(got["grads"], ref["grads"], list(ref["grads"]))
        w = rel(got["weights"], ref["weights"], list(ref["weights"]))
        g_qk = max(rel(got["grads"], ref["grads"], [k]) for k in qk)
        print(f"qwen3 {layout}: log-prob max abs {lp:.3g}, grad rel {g:.3g} (q/k norms {g_qk:.3g}), "
              f"weights rel {w:.3g}")
        assert lp < 1e-5 and g < 1e-5 and w < 1e-5 and g_qk < 1e-5


@pytest.mark.slow
def test_qwen3_moe_layouts_match_single_process(tmp_path):
    """The same parallel-equivalence worker on a tiny Qwen3-MoE at TP=2 (sequence parallelism: megatron's MoE layer
    needs it; the model pads to even lengths), PP=2, DP=2 and EP=2: log-probs, gradient and post-Adam-step weights
    equal one process's (1e-5, as for the dense models), with non-zero router and expert gradients."""
    from megatron_tsync.model.tiny_model import make_tiny_model
    from tests.training._launch import torchrun

    worker = os.path.join(common.WORKERS, "parallel_equiv_worker.py")
    model = make_tiny_model(str(tmp_path / "moe"), family="qwen3_moe", seed=0, experts=4, topk=2)
    torchrun(worker, ["--model", model, "--out-dir", str(tmp_path), "--layouts", "single"], nproc=1)
    torchrun(worker, ["--model", model, "--out-dir", str(tmp_path), "--layouts", "tp2", "pp2", "dp2", "ep2"], nproc=2)
    ref = torch.load(str(tmp_path / "single.pt"))

    def rel(a, b, keys):
        num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in keys) ** 0.5
        return num / sum(float(b[k].double().pow(2).sum()) for k in keys) ** 0.5

    moe = [k for k in ref["grads"] if ".mlp.gate.weight" in k or ".experts." in k]
    assert moe and all(ref["grads"][k].abs().max() > 0 for k in moe if ".mlp.gate.weight" in k)
    for layout in ("tp2", "pp2", "dp2", "ep2"):
        got = torch.load(str(tmp_path / f"{layout}.pt"))
        assert set(got["grads"]) == set(ref["grads"])
        lp = max(float((got["logprobs"][k] - ref["logprobs"][k]).abs().max()) for k in ref["logprobs"])
        g = rel(got["grads"], ref["grads"], list(ref["grads"]))
        w = rel(got["weights"], ref["weights"], list(ref["weights"]))
        g_moe = rel(got["grads"], ref["grads"], moe)
        print(f"qwen3_moe {layout}: log-prob max abs {lp:.3g}, grad rel {g:.3g} (router+experts {g_moe:.3g}), "
              f"weights rel {w:.3g}")
        assert lp < 1e-5 and g < 1e-5 and w < 1e-5 and g_moe < 1e-5
