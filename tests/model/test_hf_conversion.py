"""HF ⇄ Megatron conversion: bit-identical round trips (pure and through real models at TP=1, TP=2, PP=2) and
Megatron logits equal to transformers' fp32 logits.

Logit tolerance: 1e-5 absolute (measured: ~4e-7 with |logits| ≤ ~2; float32 reassociation only).
"""

import importlib.util
import json
import os

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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return common.make_models(str(tmp_path_factory.mktemp("tiny")))


def _gather_pure(shards: list[dict], pp_off: int, arch: ModelArch) -> dict:
    """Reassemble TP shards of one stage the way megatron_to_hf does, then map to HF names."""
    full = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if name.endswith("linear_fc1.weight"):
            full[name] = parts
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            full[name] = torch.cat(parts, dim=1)
        elif name.endswith("norm.weight"):
            assert all(torch.equal(parts[0], p) for p in parts)
            full[name] = parts[0]
        else:
            full[name] = torch.cat(parts, dim=0)
    return hc.megatron_full_to_hf(full, arch, pp_off, len(shards))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_pure_round_trip(models, family, tp, pp):
    arch, state = hc.load_hf_dir(models[family])
    back = {}
    for p in range(pp):
        shards = [hc.hf_to_megatron(state, arch, tp_rank=r, tp_size=tp, pp_rank=p, pp_size=pp) for r in range(tp)]
        back.update(_gather_pure(shards, hc.stage_layers(arch, p, pp)[0], arch))
    assert sorted(back) == sorted(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k


def test_qkv_layout_is_grouped_per_kv_head(models):
    arch, state = hc.load_hf_dir(models["llama"])  # 4 query heads, 2 KV groups, head_dim 32
    fused = hc.hf_to_megatron(state, arch)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    hd, qpg = arch.head_dim, arch.num_attention_heads // arch.num_kv_heads
    expect = []
    for g in range(arch.num_kv_heads):
        expect += [q[g * qpg * hd:(g + 1) * qpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    assert torch.equal(fused, torch.cat(expect))


def test_save_load_hf_dir(models, tmp_path):
    from transformers import AutoConfig

    arch, state = hc.load_hf_dir(models["qwen2"])
    hc.save_hf_dir(str(tmp_path / "out"), state, arch, tokenizer_src=models["qwen2"], max_shard_bytes=200_000)
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")  # sharded output
    arch2, state2 = hc.load_hf_dir(str(tmp_path / "out"))
    assert arch2 == arch and sorted(state2) == sorted(state)
    assert all(torch.equal(state[k], state2[k]) for k in state)
    assert os.path.exists(tmp_path / "out" / "tokenizer.json")
    cfg = AutoConfig.from_pretrained(str(tmp_path / "out"))
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings and cfg.num_key_value_heads == 1


def test_tiny_model_deterministic_and_tokenizer(models, tmp_path):
    from transformers import AutoTokenizer

    from megatron_tsync.model.tiny_model import SPECIAL_TOKENS, make_tiny_model

    again = make_tiny_model(str(tmp_path / "again"), family="llama", kv_heads=2, seed=1)
    for fn in ("model.safetensors", "tokenizer.json", "config.json"):
        with open(os.path.join(again, fn), "rb") as f1, open(os.path.join(models["llama"], fn), "rb") as f2:
            assert f1.read() == f2.read(), fn
    tok = AutoTokenizer.from_pretrained(again)
    text = "Q: 12+7*3 <tool>calculator: 12+7*3</tool><result>33</result><answer>33</answer>"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    pieces = tok.convert_ids_to_tokens(ids)
    for special in SPECIAL_TOKENS[3:]:
        assert special in pieces
    assert "12" not in pieces and "1" in pieces  # one token per digit
    assert len(tok) <= 512 and tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    arch = ModelArch.from_hf_dir(again)
    assert arch.head_dim >= 32 and arch.vocab_size % 8 == 0


def _check_report(path, expect_layouts):
    with open(path) as f:
        rep = json.load(f)
    assert {(r["tp"], r["pp"]) for r in rep} == expect_layouts
    for r in rep:
        assert r["same_keys"] and not r["mismatched"], r
        if r["pp"] == 1:
            print(f"{r['family']} tp={r['tp']}: max |logit diff| = {r['max_abs_logit_diff']:.3g}")
            assert r["max_abs_logit_diff"] <= LOGIT_TOL, r
    return rep


def test_megatron_matches_transformers_tp1(models, tmp_path):
    out = str(tmp_path / "rep.json")
    rc, log, secs = common.run_isolated([WORKER, "--hf", models["llama"], models["qwen2"], "--out", out])
    assert rc == 0, log[-4000:]
    _check_report(out, {(1, 1)})
    print(f"worker wall time {secs:.1f}s")


@pytest.mark.slow
def test_megatron_matches_transformers_tp2_and_pp2_round_trip(models, tmp_path):
    out = str(tmp_path / "rep.json")
    rc, log, secs = common.run_isolated([WORKER, "--hf", models["llama"], models["qwen2"], "--out", out],
                                        nproc=2)
    assert rc == 0, log[-4000:]
    _check_report(out, {(2, 1), (1, 2)})
    print(f"worker wall time {secs:.1f}s")


def _broken_copy(src, dst, damage):
    import shutil

    shutil.copytree(src, dst)
    damage(dst)
    return str(dst)


def _write(name, text):
    return lambda d: (d / name).write_text(text) if isinstance(text, str) else (d / name).write_bytes(text)


@pytest.mark.parametrize("damage, file, words", [
    (_write("config.json", "{}"), "config.json", "missing field(s) ['vocab_size', 'hidden_size',"),
    (_write("config.json", "garbage{"), "config.json", "not valid JSON (Expecting value: line 1 column 1"),
    (_write("config.json", "[1, 2]"), "config.json", "expected a JSON object, got list"),
    (_write("config.json", json.dumps({"model_type": "gpt2", "vocab_size": 8, "hidden_size": 8,
                                        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})),
     "config.json", "unsupported model_type 'gpt2'"),
    (_write("config.json", json.dumps({"vocab_size": 8, "hidden_size": "wide", "intermediate_size": 8,
                                        "num_hidden_layers": 1, "num_attention_heads": 1})),
     "config.json", "unsupported operand"),
    (lambda d: (d / "config.json").unlink(), "config.json", "no such file"),
    (_write("model.safetensors", os.urandom(4096)), "model.safetensors", "not a valid safetensors file"),
    (_write("model.safetensors", b""), "model.safetensors", "not a valid safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
     "model.safetensors", "not a valid safetensors file"),  # truncated
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors", "no such file"),
    (_write("model.safetensors.index.json", "{]"), "model.safetensors.index.json", "not a safetensors index"),
])
def test_a_bad_model_folder_names_the_file(models, tmp_path, damage, file, words):
    """``{}`` / garbage / missing config.json, garbage / empty / truncated / missing safetensors, a broken shard index:
    each error names the file and what is wrong with it. Control: the intact folder loads."""
    hc.load_hf_dir(models["llama"])
    bad = _broken_copy(models["llama"], tmp_path / "m", damage)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        hc.load_hf_dir(bad)
    assert os.path.join(bad, file) in str(e.value) and words in str(e.value), str(e.value)
