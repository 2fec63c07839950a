"""tools/convert_checkpoint.py: HF -> Megatron dist checkpoint (written at TP=2 or PP=2) -> HF is bit-identical;
``--verify`` reports the logit difference against transformers (and fails on a corrupted folder)."""

import importlib.util
import json
import os
import re
import shutil

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

TOOL = os.path.join(common.REPO, "tools", "convert_checkpoint.py")
_tspec = importlib.util.spec_from_file_location("convert_checkpoint_tool", TOOL)
tool = importlib.util.module_from_spec(_tspec)
_tspec.loader.exec_module(tool)
_VERIFY = re.compile(r"\[tsync\] verify: max \|Δlogits\| (\S+) \(relative \S+ of max \|logit\| \S+; fp32, "
                     r"2 sequences × 16 tokens\) against transformers on (\S+)")


def _verified(log: str, folder: str) -> float:
    m = _VERIFY.search(log)
    assert m and m.group(2) == folder, log[-4000:]
    return float(m.group(1))


def test_verify_needs_pp1():
    with pytest.raises(SystemExit):
        tool.parse_args(["--direction", "megatron-to-hf", "--load", "a", "--save", "b", "--verify",
                         "--target-pipeline-model-parallel-size", "2"])
    a = tool.parse_args(["--direction", "megatron-to-hf", "--load", "a", "--save", "b", "--verify"])
    assert a.verify and a.verify_tolerance == 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return common.make_models(str(tmp_path_factory.mktemp("tiny")))


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,pp", [("qwen2", 2, 1), ("llama", 1, 2)])
def test_hf_megatron_hf_bit_identical(megatron_single, models, tmp_path, family, tp, pp):
    from megatron_tsync.training import checkpointing as ck
    from megatron_tsync.model.hf_conversion import load_hf_dir

    src, mc, dst = models[family], str(tmp_path / "mcore"), str(tmp_path / "hf")
    rc, log, t1 = common.run_isolated([TOOL, "--direction", "hf-to-megatron", "--load", src, "--save", mc,
                                       "--target-tensor-parallel-size", str(tp),
                                       "--target-pipeline-model-parallel-size", str(pp)]
                                      + (["--verify"] if pp == 1 else []), bare=True)
    assert rc == 0, log[-4000:]
    if pp == 1:  # the converted model (TP=2: logits gathered over TP) against transformers on the source folder
        assert _verified(log, src) <= 1e-5
    meta = ck.read_meta(mc)
    assert meta["layout"]["tp"] == tp and meta["layout"]["pp"] == pp and not meta["has_optimizer"]
    rc, log, t2 = common.run_isolated([TOOL, "--direction", "megatron-to-hf", "--load", mc, "--save", dst,
                                       "--verify"], bare=True)
    assert rc == 0, log[-4000:]
    assert _verified(log, dst) <= 1e-5
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
    if family == "qwen2":  # control: --verify's comparison fails on an exported folder with one corrupted weight
        from safetensors.torch import load_file, save_file

        from megatron_tsync.model import hf_conversion as hc
        from megatron_tsync.model.builder import build_model

        model = build_model(arch0, seed=0)
        hc.load_hf_into_model(model, s0)
        bad = str(tmp_path / "hf_bad")
        shutil.copytree(dst, bad)
        w = load_file(os.path.join(bad, "model.safetensors"))
        w["model.norm.weight"] = w["model.norm.weight"] * 1.05
        save_file(w, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
        assert tool.verify_logits(model, dst, vocab_size=arch0.vocab_size, tolerance=1e-5, label="fp32") <= 1e-5
        with pytest.raises(SystemExit) as e:
            tool.verify_logits(model, bad, vocab_size=arch0.vocab_size, tolerance=1e-5, label="fp32")
        msg = str(e.value)
        print(msg)
        m = re.match(r"\[tsync\] verify FAILED: max \|Δlogits\| (\S+) .* exceeds --verify-tolerance 1e-05$", msg)
        assert m and float(m.group(1)) > 1e-3 and "\n" not in msg, msg
