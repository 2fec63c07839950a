"""tools/bench_less_work.py at a tiny size: every configuration computes today's gradient, the shared prefix and
the zero-advantage skip really happen, and the rows carry the fields the table of docs/streaming.md reads."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_less_work  # noqa: E402


def test_rows_on_small_batches(megatron_single, tmp_path):
    from transformers import AutoTokenizer

    from megatron_tsync.model.builder import ModelArch, build_model
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    make_tiny_model(str(tmp_path / "m"), seed=0)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    ddp = wrap_ddp(build_model(ModelArch(family="llama", vocab_size=512, hidden_size=32, ffn_hidden_size=64,
                                         num_layers=1, num_attention_heads=2, num_kv_heads=1, head_dim=16,
                                         max_position_embeddings=8192), seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0))
    swe = bench_less_work.swe_lite_batch(tok, groups=2, G=4)
    assert all(s.token_ids[: 20].equal(swe[0].token_ids[: 20]) for s in swe[:4])  # one prompt per group
    rows = bench_less_work._rows("swe-lite", swe, ddp, opt, 1, 4096)
    rows += bench_less_work._rows("zero-variance", bench_less_work.zero_variance_batch(groups=5, G=4, zero=2),
                                  ddp, opt, 1, 4096)
    by = {(r["batch"], r["config"]): r for r in rows}
    assert set(by) == {(b, c) for b in ("swe-lite", "zero-variance") for c in bench_less_work.CONFIGS}
    for r in rows:
        assert r["grad_rel_diff_vs_today"] < 1e-5, r  # fp32: the same update in every configuration
        assert r["learner_work_s"] > 0
    assert by[("swe-lite", "shared")]["shared"] == 8 and by[("swe-lite", "today")]["shared"] == 0
    assert by[("swe-lite", "shared")]["prompt_frac"] > 0.5
    assert by[("zero-variance", "skip")]["skipped"] == 8 and by[("zero-variance", "today")]["skipped"] == 0
    assert by[("zero-variance", "skip")]["microbatches"] <= by[("zero-variance", "today")]["microbatches"]
