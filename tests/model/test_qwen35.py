"""Qwen3.5-style Gated DeltaNet hybrids (``qwen3_5``: linear-attention + gated full-attention layers, model/qwen35.py).

- the tiny model (tools/make_tiny_model.py --family qwen3.5) is transformers' own Qwen3_5TextConfig /
  Qwen3_5ForCausalLM with linear and full attention alternating;
- config: ModelArch from the text config.json and from the multimodal one (``text_config`` inside), refusals;
- pure conversion HF → (TP, PP) shards → HF bit-identical; through the float64 model bit-identical;
- logits: Megatron float64 vs transformers float64 ≤ 1e-12 relative in one process, transformers' float32 casts
  lifted (tests/model/_qwen35_reference.py); Megatron float32 vs the unmodified transformers model in float32;
  controls: a zero-centred norm read as plain, and the linear layers' decay off, both move the logits;
- sequence packing: a block-causal packed forward equals the sequences' own forwards (the conv and the recurrent
  state restart at each segment); another mask is refused;
- the embedded engine generates with it (the linear layers' recurrent state kept in megatron's inference context
  as their "KV cache"; left-padded batches): greedy tokens and log-probs = the trainer's.
"""

import json
import os

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model import qwen35
from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model, transformer_config

from ._qwen35_reference import float64_transformers, hf_model

TOL = 1e-12


@pytest.fixture(scope="module")
def tiny_q35(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("q35") / "qwen3_5"), family="qwen3.5", hidden=64, seed=3)


def _ids(vocab, b=2, s=24, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))  # (B, S)


def _state64(state):
    return {k: v.double() for k, v in state.items()}


@pytest.fixture(scope="module")
def megatron64(tiny_q35, megatron_single):
    arch, state = hc.load_hf_dir(tiny_q35)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0)
    hc.load_hf_into_model(model, _state64(state))
    return model


def _logits(model, ids, **kw):
    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits, model_logits

    model.eval()
    with torch.no_grad():
        return gather_vocab_parallel_logits(model_logits(model, ids, **kw))  # (B, S, V)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def ref64(tiny_q35):
    ids = _ids(512)
    with float64_transformers(), torch.no_grad():
        return ids, hf_model(tiny_q35)(ids).logits  # (B, S, V)


def test_float64_logits_equal_transformers(megatron64, ref64):
    ids, ref = ref64
    mine = _logits(megatron64, ids)
    rel = _rel(mine, ref)
    print(f"qwen3_5 float64 logits: max |Δ| / max |logit| = {rel:.3g}")
    assert ref.dtype == mine.dtype == torch.float64 and rel <= TOL


def test_float32_logits_close_to_unmodified_transformers(tiny_q35, megatron_single):
    """float32 megatron vs transformers as shipped (float32, eager): the same model up to float32 rounding."""
    arch, state = hc.load_hf_dir(tiny_q35)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float32), seed=0)
    hc.load_hf_into_model(model, state)
    ids = _ids(arch.vocab_size)
    with torch.no_grad():
        ref = hf_model(tiny_q35, torch.float32)(ids).logits
    rel = _rel(_logits(model, ids), ref)
    print(f"qwen3_5 float32 logits vs unmodified transformers: {rel:.3g}")
    assert rel < 1e-5, rel


@pytest.mark.parametrize("control", ["plain_norm", "no_decay"])
def test_controls_move_the_logits(megatron64, ref64, control, monkeypatch):
    """Controls: the zero-centred norms computed as plain ``x/rms·w``, or the linear layers' decay switched off
    (A_log → −∞): either moves the logits far above the tolerance (the test above would see such a bug)."""
    from megatron_tsync.model import gdn_layer

    ids, ref = ref64
    a_logs = [layer.self_attention.A_log for layer in megatron64.decoder.layers if hasattr(layer.self_attention,
                                                                                          "A_log")]
    saved = [a.detach().clone() for a in a_logs]
    if control == "plain_norm":
        def plain(self, x):  # x / rms · w instead of · (1 + w)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

        monkeypatch.setattr(gdn_layer.ZeroCenteredRMSNorm, "forward", plain)
    else:
        with torch.no_grad():
            for a in a_logs:
                a.fill_(-1e4)
    try:
        assert _rel(_logits(megatron64, ids), ref) > 1e-6
    finally:
        with torch.no_grad():
            for a, s in zip(a_logs, saved):
                a.copy_(s)


# ---------------------------------------------------------------------------------------------- config
TEXT_JSON = dict(  # the keys of Qwen3.5's text config (sizes shrunk)
    model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False, linear_conv_kernel_dim=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)


def test_arch_from_config_json():
    arch = ModelArch.from_hf_config(TEXT_JSON)
    assert arch.family == "qwen3_5" and arch.layer_types[3] == "full_attention" and arch.partial_rotary_factor == 0.25
    assert (arch.linear_num_key_heads, arch.linear_num_value_heads, arch.linear_key_head_dim) == (2, 4, 16)
    assert ModelArch.from_hf_config(hc.hf_config_dict(arch)) == arch  # config.json written back reads the same
    vlm = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": {**TEXT_JSON},
           "vision_config": {"depth": 2}}
    assert ModelArch.from_hf_config(vlm) == arch
    no_types = {k: v for k, v in TEXT_JSON.items() if k != "layer_types"}
    assert ModelArch.from_hf_config({**no_types, "full_attention_interval": 4}) == arch


@pytest.mark.parametrize("change,match", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "silu only"),
    (dict(layer_types=["linear_attention"] * 3), "must name 4 layers"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "plain RoPE only"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.03}), "rotary"),
    (dict(linear_num_value_heads=3), "multiple of"),
])
def test_unsupported_layouts_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config({**TEXT_JSON, **change})


def test_transformer_config_and_refused_options():
    arch = ModelArch.from_hf_config(TEXT_JSON)
    cfg = transformer_config(arch, PrecisionConfig())
    assert cfg.experimental_attention_variant == "gated_delta_net" and cfg.linear_attention_freq == [1, 1, 1, 0]
    assert cfg.attention_output_gate and cfg.layernorm_zero_centered_gamma and cfg.qk_layernorm
    with pytest.raises(ValueError, match="sequence parallelism is not built"):
        transformer_config(arch, PrecisionConfig(), sequence_parallel=True)
    with pytest.raises(ValueError, match="divisible by TP=4"):
        transformer_config(arch, PrecisionConfig(), tp=4)


def test_make_tiny_model_cli(tmp_path):
    """``tools/make_tiny_model.py --family qwen3.5`` writes a folder ModelArch reads as qwen3_5."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_tiny_model_tool", os.path.join(os.path.dirname(__file__), "..", "..", "tools", "make_tiny_model.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = str(tmp_path / "cli")
    tool.main(["--out", out, "--family", "qwen3.5", "--hidden", "64", "--layers", "2"])
    arch = ModelArch.from_hf_dir(out)
    assert arch.family == "qwen3_5" and arch.layer_types == ("linear_attention", "full_attention")


def test_tiny_model_is_transformers_model(tiny_q35):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_q35)
    assert type(cfg).__name__ == "Qwen3_5TextConfig" and set(cfg.layer_types) == {"linear_attention",
                                                                                  "full_attention"}
    hf = hf_model(tiny_q35, torch.float32)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    assert type(hf.model.layers[0].linear_attn).__name__ == "Qwen3_5GatedDeltaNet"
    assert cfg.linear_num_value_heads > cfg.linear_num_key_heads  # grouped value heads


# ---------------------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_pure_round_trip(tiny_q35, tp, pp):
    """HF → every (TP, PP) rank's megatron tensors → gathered back → HF, bit-identical per tensor."""
    arch, state = hc.load_hf_dir(tiny_q35)
    back = {}
    for p in range(pp):
        shards = [hc.hf_to_megatron(state, arch, tp_rank=r, tp_size=tp, pp_rank=p, pp_size=pp) for r in range(tp)]
        full = {}
        for name in shards[0]:
            parts = [s[name] for s in shards]
            if name.endswith("linear_fc1.weight"):
                full[name] = parts
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")):
                full[name] = torch.cat(parts, dim=1)
            elif name.endswith("norm.weight"):
                assert all(torch.equal(parts[0], x) for x in parts)  # replicated over TP
                full[name] = parts[0]
            else:
                full[name] = torch.cat(parts, dim=0)
        back.update(hc.megatron_full_to_hf(full, arch, p * arch.num_layers // pp, tp))
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_multimodal_names_are_read_as_text(tiny_q35):
    _, state = hc.load_hf_dir(tiny_q35)
    vlm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    vlm["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(2, 2)
    vlm["mtp.fc.weight"] = torch.zeros(2, 2)
    assert qwen35.text_state(vlm).keys() == state.keys()


def test_model_round_trip(tiny_q35, megatron64):
    _, state = hc.load_hf_dir(tiny_q35)
    back = hc.megatron_to_hf(megatron64)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], _state64(state)[k]) for k in state)


def test_fp8_is_refused(tiny_q35, megatron_single):
    arch, _ = hc.load_hf_dir(tiny_q35)
    with pytest.raises(ValueError, match="no FP8"):
        build_model(arch, PrecisionConfig(fp8_format="e4m3"))


# ---------------------------------------------------------------------------------------------- packing
def test_packed_forward_equals_separate_sequences(megatron64):
    """Two sequences packed into one row with a block-diagonal causal mask (positions restarting), and as THD
    (``cu_seqlens``): every position's logits equal the sequences' own forwards ≤ 1e-12; control: the same pack without the mask differs in the
    second sequence (the recurrent state and the conv window would otherwise run across the boundary)."""
    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits

    a, b = _ids(512, b=1, s=9, seed=1), _ids(512, b=1, s=13, seed=2)
    ids = torch.cat([a, b], dim=1)  # (1, 22)
    pos = torch.cat([torch.arange(9), torch.arange(13)])[None]
    mask = torch.ones(22, 22, dtype=torch.bool)
    mask[:9, :9] = torch.ones(9, 9, dtype=torch.bool).triu(1)
    mask[9:, 9:] = torch.ones(13, 13, dtype=torch.bool).triu(1)
    megatron64.eval()
    with torch.no_grad():
        packed = gather_vocab_parallel_logits(megatron64(ids, pos, mask[None, None]))  # (1, 22, V)
        unmasked = gather_vocab_parallel_logits(megatron64(ids, pos, None))
    own = torch.cat([_logits(megatron64, a), _logits(megatron64, b)], dim=1)
    assert _rel(packed, own) <= TOL
    from megatron_tsync.training.packing import layout_for

    with torch.no_grad():  # THD packing (cu_seqlens, no mask): the same restarts
        thd = gather_vocab_parallel_logits(megatron64(ids, pos, None,
                                                      packed_seq_params=layout_for([9, 13]).packed_seq_params()))
    assert _rel(thd, own) <= TOL
    assert _rel(unmasked[:, 9:], own[:, 9:]) > 1e-6
    other = mask.clone()
    other[5, 2] = True  # a hole inside a segment: neither packing nor left padding
    with pytest.raises(ValueError, match="causal sequences"), torch.no_grad():
        megatron64(ids, pos, other[None, None])


@pytest.mark.parametrize("cache", [True, False], ids=["recurrent-state-cache", "no-cache"])
def test_embedded_engine_generates_with_the_trainers_logprobs(tiny_q35, megatron64, cache):
    """The embedded engine (float64) on prompts of 3, 17 and 30 tokens (left-padded to one batch; a row finishes
    early through a stop token, so the cache drops rows): greedy tokens are the trainer's full-forward argmax and the
    log-probs the trainer's ≤ 1e-12 — with the linear layers' recurrent state kept in megatron's inference context
    (``cache``) and without a cache (full recompute with the padding mask)."""
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig

    engine = EmbeddedEngine.from_hf_dir(tiny_q35, PrecisionConfig(params_dtype=torch.float64), use_kv_cache=cache)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(9, 512, (n,), generator=g).tolist() for n in (3, 17, 30)]
    first = engine.generate(prompts[:1], SamplingConfig(top_k=1, max_new_tokens=4, seed=0))[0][0].token_ids
    out = engine.generate(prompts, SamplingConfig(top_k=1, max_new_tokens=12, seed=0, stop_token_ids=(first[3],)))
    worst, lengths = 0.0, []
    for p, (c,) in zip(prompts, out):
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logits = _logits(megatron64, ids)[0, len(p) - 1 : -1]  # (n, V)
            lp = token_logprobs(megatron64, ids)[0, len(p) - 1 :]  # (n,)
        assert logits.argmax(-1).tolist() == c.token_ids
        worst = max(worst, (lp - torch.tensor(c.logprobs, dtype=lp.dtype)).abs().max().item())
        lengths.append(len(c.token_ids))
    print(f"qwen3_5 embedded engine (cache={cache}) vs trainer log-prob max |diff| = {worst:.3g}, lengths {lengths}")
    assert worst <= TOL and lengths[0] == 4 and max(lengths) == 12


# ---------------------------------------------------------------------------------------------- TP = 2, PP = 2, tool
def _conv_common():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    return common


@pytest.fixture(scope="module")
def q35_two_procs(tiny_q35, tmp_path_factory):
    """One launch of _qwen35_worker.py (two gloo processes, TP = 2 then PP = 2) for both tests below: (logits
    report, {layout: {mode: gradient under HF names}})."""
    d = tmp_path_factory.mktemp("q35_two_procs")
    out, stream_out = str(d / "rep.json"), str(d / "stream.pt")
    worker = os.path.join(os.path.dirname(__file__), "_qwen35_worker.py")
    rc, log, _ = _conv_common().run_isolated([worker, "--hf", tiny_q35, "--out", out, "--stream-out", stream_out],
                                             nproc=2, timeout=600)
    assert rc == 0, log[-4000:]
    with open(out) as f:
        return json.load(f), torch.load(stream_out)


@pytest.mark.slow
def test_float64_logits_tp2_pp2(q35_two_procs):
    """Two gloo processes: TP=2 (heads of both mixers split), then PP=2 (two layers a stage, each stage both
    kinds): float64 logits equal transformers' ≤ 1e-12 relative, the round trip through the sharded model is
    bit-identical."""
    rep = q35_two_procs[0]
    assert {(r["tp"], r["pp"]) for r in rep} == {(2, 1), (1, 2)}
    for r in rep:
        print(f"qwen3_5 tp={r['tp']} pp={r['pp']}: float64 logits rel diff {r['rel_logit_diff']:.3g}")
        assert r["same_keys"] and not r["mismatched"], r
        assert r["rel_logit_diff"] <= TOL and r["ranks_with_logits"] == (2 if r["pp"] == 1 else 1), r
    assert {r["pp"]: r["layers"] for r in rep}[2] == 2


@pytest.mark.slow
def test_streaming_tp2_pp2_equal_one_process(tiny_q35, q35_two_procs, megatron_single):
    """The learner at TP = 2 and PP = 2 (float64 GRPO, bounded rewards, π_old from the trainer): sync,
    stream-trajectory and stream-group gradients equal one process's sync gradient ≤ 1e-12 — every tensor, the
    gated norm's weight among them (per value head: its gradient summed over TP, gdn_layer.PlainRMSNorm)."""
    from ..training.stream_cases import rel_error
    from ._glm_worker import _moe_ep_worker

    w = _moe_ep_worker()
    one = w.run_case(tiny_q35, megatron_single, w.CASES["grpo-bounded-trainer"], "sync", None)[0]
    assert any(k.endswith("linear_attn.norm.weight") for k in one)
    for layout, modes in q35_two_procs[1].items():
        assert set(modes) == {"sync", "stream-trajectory", "stream-group"}
        for mode, g in modes.items():
            r = rel_error(g, one)
            worst = max(rel_error({k: g[k]}, {k: one[k]}) for k in one)
            print(f"qwen3_5 {layout} {mode}: vs one process {r:.2g} (worst tensor {worst:.2g})")
            assert r < TOL and worst < 1e-10, (layout, mode, r, worst)


@pytest.mark.slow
def test_convert_checkpoint_tool_verify(tiny_q35, tmp_path):
    """tools/convert_checkpoint.py HF → Megatron → HF with --verify both ways (float32, one process): passes, and
    the exported folder is bit-identical to the source."""
    driver = os.path.join(os.path.dirname(__file__), "_convert_driver.py")
    ck, back = str(tmp_path / "ck"), str(tmp_path / "back")
    with open(tmp_path / "jobs.json", "w") as f:
        json.dump([["--direction", "hf-to-megatron", "--load", tiny_q35, "--save", ck, "--verify"],
                   ["--direction", "megatron-to-hf", "--load", ck, "--save", back, "--verify"]], f)
    rc, out, _ = _conv_common().run_isolated([driver, "--jobs", str(tmp_path / "jobs.json")], timeout=600, bare=True)
    assert rc == 0 and out.count("[tsync] verify:") == 2, out[-3000:]
    a, b = hc.load_hf_state(tiny_q35), hc.load_hf_state(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3_5_text"


@pytest.mark.slow
def test_opd_stream_turn_tp2_pp2(tiny_q35, tmp_path):
    """OPD stream-turn at TP = 2 and PP = 2 (the per-chunk p2p path, every rank): = sync ≤ 1e-12; the turn-cut
    control > 1e-3 (tests/model/_qwen35_opd_worker.py)."""
    out = str(tmp_path / "opd.json")
    worker = os.path.join(os.path.dirname(__file__), "_qwen35_opd_worker.py")
    rc, log, _ = _conv_common().run_isolated([worker, "--hf", tiny_q35, "--out", out], nproc=2, timeout=600)
    assert rc == 0, log[-4000:]
    with open(out) as f:
        rep = json.load(f)
    for layout, row in rep.items():
        print(f"qwen3_5 OPD {layout}: stream-turn {row['stream-turn']['rel']:.2g}, cut {row['cut']['rel']:.2g}")
        assert row["stream-turn"]["rel"] <= TOL and max(row["stream-turn"]["rel_this_rank"]) <= TOL, row
        assert set(row["stream-turn"]["ran"]) == {"stream-turn"} and row["cut"]["rel"] > 1e-3, row
        msgs = row["stream-turn"]["p2p_messages"]
        assert (min(msgs) > 0) if layout == "pp2" else (max(msgs) == 0), (layout, msgs)
