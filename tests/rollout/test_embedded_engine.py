"""The embedded engine against the trainer's log-probs, its stops, seeding, batching and the engine contract.

Tiny Llama (hidden 128, 2 layers, 4 heads, 2 KV heads, vocab 512), float32, TP=1, gloo on CPU.
"""

import dataclasses
import os
import socket

import pytest
import torch

torch.set_num_threads(1)

from megatron_tsync.rollout.engine import Completion, SamplingConfig, check_engine_contract, derive_seed  # noqa: E402

ATOL = 1e-5


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def parallel():
    import torch.distributed as dist

    from megatron_tsync.model.parallel import initialize_parallel

    if not dist.is_initialized():
        os.environ["MASTER_PORT"] = _free_port()
    return initialize_parallel(1, 1, seed=0)


@pytest.fixture(scope="module")
def setup(parallel, tiny_dir):
    """(engine, trainer model, hf state): both built from the same HF folder."""
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.builder import build_model

    arch, state = load_hf_dir(tiny_dir)
    engine = EmbeddedEngine.from_hf_dir(tiny_dir)
    trainer = build_model(arch, seed=1)
    load_hf_into_model(trainer, state)
    trainer.eval()
    return engine, trainer, state


def reference(model):
    """The trainer's log-probs (token_logprobs) of a completion given its prompt."""
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


def tokens(out):
    return [[c.token_ids for c in comps] for comps in out]


def restore(engine, trainer, state):
    from megatron_tsync.model.hf_conversion import load_hf_into_model

    load_hf_into_model(trainer, state)
    engine.update_weights(state, 0)


def test_logprobs_match_trainer_before_and_after_update(setup):
    from megatron_tsync.model.hf_conversion import megatron_to_hf

    engine, trainer, state = setup
    ref = reference(trainer)
    prompts = prompts_of([3, 17, 9, 30])
    cfg = SamplingConfig(max_new_tokens=24, seed=11)
    before = engine.generate(prompts, cfg, n=3)
    d_t1 = max_diff(prompts, before, ref, 1.0)
    cfg07 = dataclasses.replace(cfg, temperature=0.7)
    out07 = engine.generate(prompts, cfg07, n=3)
    d_t07 = max_diff(prompts, out07, ref, 0.7)
    # Raw-logit (T=1) log-probs must NOT be what the engine reports at T=0.7.
    assert max_diff(prompts, out07, ref, 1.0) > 1e-3
    try:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # a real update: every weight moves
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        engine.update_weights(megatron_to_hf(trainer), 1)  # Hugging Face names
        assert engine.policy_version == 1
        after = engine.generate(prompts, cfg, n=3)
        assert all(c.policy_version == 1 for comps in after for c in comps)
        assert tokens(after) != tokens(before), "samples did not change with the weights"
        d_after = max_diff(prompts, after, ref, 1.0)
        d_after07 = max_diff(prompts, engine.generate(prompts, cfg07, n=2), ref, 0.7)
        # Megatron names: perturb again and load the trainer's own state dict.
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        engine.update_weights(trainer.state_dict(), 2)
        again = engine.generate(prompts, cfg, n=3)
        assert tokens(again) != tokens(after)
        d_meg = max_diff(prompts, again, ref, 1.0)
    finally:
        restore(engine, trainer, state)
    print(f"\nlog-prob max |diff|: T=1 {d_t1:.2e}, T=0.7 {d_t07:.2e}, after HF update {d_after:.2e} "
          f"(T=0.7 {d_after07:.2e}), after megatron update {d_meg:.2e}")
    for d in (d_t1, d_t07, d_after, d_after07, d_meg):
        assert d <= ATOL


def test_update_by_broadcast_matches_file_update(setup, tmp_path):
    """--weight-sync broadcast into the embedded engine (what a rollout worker does: receive CPU tensors over gloo,
    then ``update_weights``): samples and log-probs are identical to those after the signed-file hand-off of the
    same weights, and match the trainer's log-probs."""
    import threading

    from megatron_tsync.model.hf_conversion import megatron_to_hf
    from megatron_tsync.transport.weight_broadcast import (
        BroadcastWeightPublisher,
        BroadcastWeightSubscriber,
        WeightSyncGroup,
    )
    from megatron_tsync.transport.weights import WeightSubscriber, publish_weights

    engine, trainer, state = setup
    key = bytes(range(32))
    g = torch.Generator().manual_seed(9)
    prompts, cfg = prompts_of([3, 17, 9], seed=5), SamplingConfig(max_new_tokens=16, seed=2)
    try:
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        new = megatron_to_hf(trainer)
        publish_weights(new, tmp_path, 1, key)
        engine.update_weights(*reversed(WeightSubscriber(tmp_path, key).wait_for(1, timeout_s=10)))
        by_file = engine.generate(prompts, cfg, n=2)
        engine.update_weights(state, 0)  # back to the old weights: the broadcast must bring the new ones

        g0 = WeightSyncGroup.host(2, op_timeout_s=60)
        pub = BroadcastWeightPublisher(g0, key, bucket_bytes=128 << 10)
        sender = threading.Thread(target=pub.publish, args=(new, 2))
        sender.start()
        sub = BroadcastWeightSubscriber(WeightSyncGroup.join("127.0.0.1", g0.port, 1, 2, connect_timeout_s=60,
                                                             op_timeout_s=60), key)
        version, got = sub.wait_for(2, timeout_s=60)
        sender.join(timeout=60)
        engine.update_weights(got, version)
        by_bcast = engine.generate(prompts, cfg, n=2)
        assert engine.policy_version == 2 and sub.last_stats["buckets"] > 1 and not sub.rejected
        assert [[(c.token_ids, c.logprobs) for c in cs] for cs in by_bcast] == \
            [[(c.token_ids, c.logprobs) for c in cs] for cs in by_file]
        d = max_diff(prompts, by_bcast, reference(trainer), 1.0)
        print(f"\nbroadcast update: {sub.last_stats}, log-prob max |diff| vs trainer {d:.2e}")
        assert d <= ATOL
        pub.close()
        sub.group.close()
    finally:
        restore(engine, trainer, state)


def test_stops_on_tool_close_and_eos(setup, tiny_dir):
    """Greedy decode; then make `</tool>` (or EOS) the argmax at step 3 by swapping output rows: generation must
    end right there with the stop token kept and the right finish reason."""
    from megatron_tsync.model.tokenizer import TokenizerCodec, tag_token_id
    from tokenizers import Tokenizer

    engine, trainer, state = setup
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json")))
    tool_id, eos_id = tag_token_id(codec, "</tool>"), tag_token_id(codec, "</s>")
    greedy = SamplingConfig(top_k=1, max_new_tokens=8, tool_token_ids=(tool_id,), stop_token_ids=(eos_id,))
    prompt = prompts_of([12], seed=3)
    base = engine.generate(prompt, greedy)[0][0].token_ids
    # the first step k ≥ 2 whose greedy token is new (swapping its row leaves steps < k unchanged)
    k = next(i for i in range(2, 8) if base[i] not in base[:i])
    assert tool_id not in base[: k + 1] and eos_id not in base[: k + 1]
    for stop_id, reason in ((tool_id, "tool"), (eos_id, "stop")):
        sd = {k_: v.clone() for k_, v in trainer.state_dict().items() if torch.is_tensor(v)}
        w = sd["output_layer.weight"]
        w[[stop_id, base[k]]] = w[[base[k], stop_id]]
        try:
            engine.update_weights(sd, 7)
            c = engine.generate(prompt, greedy, n=2)[0]
        finally:
            restore(engine, trainer, state)
        for comp in c:
            assert comp.token_ids == base[:k] + [stop_id], (comp.token_ids, base)
            assert comp.finish_reason == reason and len(comp.logprobs) == k + 1
            assert comp.sampling_logprobs == [0.0] * (k + 1)  # greedy: the truncated distribution is a point mass
    # Stop decided per row: other rows keep generating to max_new_tokens.
    others = prompts_of([5, 7], seed=4)
    out = engine.generate([others[0], prompt[0], others[1]], dataclasses.replace(greedy, tool_token_ids=(base[k],)))
    assert out[1][0].finish_reason == "tool" and out[1][0].token_ids == base[: k + 1]
    assert any(o[0].finish_reason == "length" and len(o[0].token_ids) == 8 for o in out)


def test_stop_strings(setup, tiny_dir):
    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from tokenizers import Tokenizer

    engine, _, _ = setup
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json")))
    eng = EmbeddedEngine(engine.model, detokenize=codec.decode)
    cfg = SamplingConfig(max_new_tokens=16, seed=5)
    prompt = prompts_of([8], seed=9)
    base = eng.generate(prompt, cfg)[0][0].token_ids
    stop = codec.decode(base[5:7])
    first = next(i for i in range(16) if stop in codec.decode(base[max(0, i - 31) : i + 1]))
    c = eng.generate(prompt, dataclasses.replace(cfg, stop_strings=(stop,)))[0][0]
    assert c.token_ids == base[: first + 1] and c.finish_reason == "stop"


def test_seeded_determinism_batching_and_kv_cache(setup):
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    engine, trainer, _ = setup
    prompts = prompts_of([4, 25, 11, 2, 16])
    cfg = SamplingConfig(max_new_tokens=16, seed=123, stop_token_ids=tuple(range(9, 40)))
    a = engine.generate(prompts, cfg, n=3)
    assert tokens(engine.generate(prompts, cfg, n=3)) == tokens(a)
    assert tokens(engine.generate(prompts, dataclasses.replace(cfg, seed=124), n=3)) != tokens(a)
    lens = {len(c.token_ids) for comps in a for c in comps}
    assert len(lens) > 1, "expected completions of different lengths (per-row stops)"
    # Chunked batches and the no-cache fallback give the same samples; log-probs agree to rounding.
    chunked = EmbeddedEngine(engine.model, max_batch_rows=4)
    full = EmbeddedEngine(engine.model, use_kv_cache=False)
    assert tokens(chunked.generate(prompts, cfg, n=3)) == tokens(a)
    b = full.generate(prompts, cfg, n=3)
    assert tokens(b) == tokens(a)
    diff = max(abs(x - y) for ca, cb in zip(a, b) for u, v in zip(ca, cb) for x, y in zip(u.logprobs, v.logprobs))
    assert diff < 2e-6
    # Per-prompt seeds: a request's samples do not depend on what else is in the batch.
    s = [derive_seed(9, i) for i in range(len(prompts))]
    together = engine.generate(prompts, cfg, seeds=s)
    for i in (0, 3):
        assert engine.generate([prompts[i]], cfg, seeds=[s[i]])[0][0].token_ids == together[i][0].token_ids
    # Unseeded calls are not reproducible (by request).
    un = dataclasses.replace(cfg, seed=None, stop_token_ids=())
    assert tokens(engine.generate(prompts, un)) != tokens(engine.generate(prompts, un))


def test_top_k_top_p(setup):
    engine, trainer, _ = setup
    prompts = prompts_of([6, 13])
    cfg = SamplingConfig(temperature=0.8, top_k=5, top_p=0.5, max_new_tokens=10, seed=3)
    out = engine.generate(prompts, cfg, n=4)
    ref = reference(trainer)
    assert max_diff(prompts, out, ref, 0.8) <= ATOL  # logprobs: untruncated T-scaled distribution
    from megatron_tsync.model.logprobs import model_logits

    for p, comps in zip(prompts, out):
        for c in comps:
            assert c.sampling_logprobs is not None and len(c.sampling_logprobs) == len(c.token_ids)
            with torch.no_grad():
                logits = model_logits(trainer, torch.tensor([p + c.token_ids]))[0, len(p) - 1 : -1]
            top5 = torch.topk(logits, 5, dim=-1).indices
            assert all(t in top5[i].tolist() for i, t in enumerate(c.token_ids))
            assert all(s >= lp - 1e-6 for s, lp in zip(c.sampling_logprobs, c.logprobs))


def test_engine_contract(setup):
    from megatron_tsync.rollout.engine import RolloutEngine

    engine, trainer, state = setup
    assert isinstance(engine, RolloutEngine)
    new = {k: v.clone() for k, v in trainer.state_dict().items() if torch.is_tensor(v)}
    g = torch.Generator().manual_seed(0)
    for k, v in new.items():
        if v.is_floating_point():
            v.add_(0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype))
    from megatron_tsync.model.builder import build_model

    new_model = build_model(trainer.arch, seed=2)
    new_model.load_state_dict(new, strict=False)
    new_model.eval()
    try:
        report = check_engine_contract(
            engine,
            prompts=prompts_of([5, 14, 9]),
            vocab_size=512,
            reference_logprobs=reference(trainer),
            update=(new, reference(new_model)),
        )
    finally:
        restore(engine, trainer, state)
    print("\ncontract:", {k: f"{v:.2e}" for k, v in report.items()})
    assert set(report) == {"logprob_max_abs_diff_t1", "logprob_max_abs_diff_t0.7", "logprob_max_abs_diff_after_update"}


def test_contract_catches_raw_logit_logprobs(setup):
    """An engine that reports T=1 log-probs at T≠1 (megatron.core.inference's behaviour) fails the contract."""
    engine, trainer, _ = setup

    class RawLogprobEngine:
        policy_version = 0

        def generate(self, prompts, sampling, n=1, *, seeds=None):
            out = engine.generate(prompts, sampling, n, seeds=seeds)
            ref = reference(trainer)
            return [
                [dataclasses.replace(c, logprobs=ref(p, c.token_ids, 1.0)) for c in comps]
                for p, comps in zip(prompts, out)
            ]

        def update_weights(self, state_dict, version):
            raise NotImplementedError

    with pytest.raises(AssertionError, match="t0.7"):
        check_engine_contract(RawLogprobEngine(), prompts=prompts_of([5, 9]), vocab_size=512,
                              reference_logprobs=reference(trainer))


def test_rejects_bad_requests(setup):
    engine, _, _ = setup
    with pytest.raises(ValueError):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError):
        engine.generate([[]], SamplingConfig())
    with pytest.raises(ValueError):
        engine.generate([[5, 6]], SamplingConfig(stop_strings=("x",)))  # no detokenizer
    with pytest.raises(KeyError):
        engine.update_weights({"output_layer.weight": torch.zeros(512, 128)}, 3)
    assert engine.policy_version == 0
    assert isinstance(engine.generate([[5, 6]], SamplingConfig(max_new_tokens=2))[0][0], Completion)
