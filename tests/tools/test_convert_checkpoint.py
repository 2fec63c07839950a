"""tools/convert_checkpoint.py: HF -> Megatron dist checkpoint (written at TP=2 or PP=2) -> HF is bit-identical."""

import importlib.util
import json
import os

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

TOOL = os.path.join(common.REPO, "tools", "convert_checkpoint.py")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return common.make_models(str(tmp_path_factory.mktemp("tiny")))


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,pp", [("qwen2", 2, 1), ("llama", 1, 2)])
def test_hf_megatron_hf_bit_identical(models, tmp_path, family, tp, pp):
    from megatron_tsync.training import checkpointing as ck
    from megatron_tsync.model.hf_conversion import load_hf_dir

    src, mc, dst = models[family], str(tmp_path / "mcore"), str(tmp_path / "hf")
    rc, log, t1 = common.run_isolated([TOOL, "--direction", "hf-to-megatron", "--load", src, "--save", mc,
                                       "--target-tensor-parallel-size", str(tp),
                                       "--target-pipeline-model-parallel-size", str(pp)], bare=True)
    assert rc == 0, log[-4000:]
    meta = ck.read_meta(mc)
    assert meta["layout"]["tp"] == tp and meta["layout"]["pp"] == pp and not meta["has_optimizer"]
    rc, log, t2 = common.run_isolated([TOOL, "--direction", "megatron-to-hf", "--load", mc, "--save", dst],
                                      bare=True)
    assert rc == 0, log[-4000:]
    arch0, s0 = load_hf_dir(src)
    arch1, s1 = load_hf_dir(dst)
    assert arch0 == arch1 and sorted(s0) == sorted(s1)
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(src, fn), "rb") as a, open(os.path.join(dst, fn), "rb") as b:
            assert a.read() == b.read()
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["eos_token_id"] == 1 and cfg["model_type"] == family
    print(f"{family} TP={tp} PP={pp}: hf->megatron {t1:.1f}s, megatron->hf {t2:.1f}s")
