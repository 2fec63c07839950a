"""Convert between a Hugging Face folder (Llama incl. Llama-3.x rope scaling / Qwen2 / Qwen3 / Qwen3-MoE,
safetensors) and a Megatron distributed checkpoint.

    # HF -> Megatron torch_dist checkpoint, written by a TP=2 x PP=1 layout
    python tools/convert_checkpoint.py --direction hf-to-megatron --load HF_DIR --save CKPT_DIR \\
        --target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 1
    # Megatron checkpoint (any layout it was saved at, with or without optimizer state) -> HF
    python tools/convert_checkpoint.py --direction megatron-to-hf --load CKPT_DIR --save HF_DIR

The Megatron side uses megatron_tsync's checkpoint layout (``CKPT_DIR/iter_0000000/`` +
``latest_checkpointed_iteration.txt``; see megatron_tsync/training/checkpointing.py); a converted HF model is
saved as step 0 without optimizer state, with its config and tokenizer under ``CKPT_DIR/hf_assets``.
dist_checkpointing reshards on load, so the layout used here only decides how the files are written (HF ->
Megatron) or how many processes share the work (Megatron -> HF).

Processes: under torchrun (or srun) the launcher's ranks are used (world size a multiple of TP x PP x EP; TP/PP/EP
are the ``--target-*`` sizes; EP, for MoE models, is carved out of the data-parallel ranks). Started as a single
process with TP x PP x EP > 1, the tool spawns that many local processes itself (gloo on CPU, NCCL on GPUs).

``--verify`` (either direction) checks the conversion by logits: after converting, the Megatron model (the one this
process converted, no second build) and ``transformers`` (AutoModelForCausalLM, float32, eager attention, on the HF
side's folder: the exported folder for megatron-to-hf, the source folder for hf-to-megatron) run the same fixed
2 sequences x 16 tokens; rank 0 prints the max absolute and relative logit difference and exits non-zero with one
line when max |Δlogits| / max(1, max |logit|) exceeds ``--verify-tolerance`` (default 1e-5, meant for float32
checkpoints: fp32 rounding grows with the logits' scale — a tiny Qwen3-MoE, whose experts are summed in another
order than transformers sums them, differs by 1.0e-5 at max |logit| 10, i.e. 8 units of fp32 rounding; a
conversion bug such as a norm scaled by 1.05 gives ~1e-2; bf16/fp16 models differ by their compute rounding, pass a
tolerance for them). Works at any TP/EP (vocab-parallel logits are gathered to rank 0);
needs PP=1 (for megatron-to-hf just convert at PP=1: checkpoints reshard on load).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

# first, before anything imports megatron.core: its import then skips torch's compiler stack, wandb and TensorBoard
# (megatron_tsync/__init__.py; ~2.5 CPU-s per process). Also for tests/model/_convert_driver.py, which imports
# megatron.core itself right after loading this tool.
import megatron_tsync  # noqa: F401

VERIFY_SEQUENCES, VERIFY_TOKENS = 2, 16
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--direction", choices=["hf-to-megatron", "megatron-to-hf"], required=True)
    p.add_argument("--load", required=True, help="source folder (HF folder or Megatron checkpoint root)")
    p.add_argument("--save", required=True, help="destination folder")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="TP of the converting layout")
    p.add_argument("--target-pipeline-model-parallel-size", type=int, default=1, help="PP of the converting layout")
    p.add_argument("--target-expert-model-parallel-size", type=int, default=1,
                   help="EP of the converting layout (MoE: each of EP ranks converts E/EP experts; uses TP x PP x EP "
                        "processes)")
    p.add_argument("--step", type=int, default=None, help="megatron-to-hf: iteration to export (default: latest)")
    p.add_argument("--tokenizer", default=None, help="megatron-to-hf: folder with tokenizer files "
                   "(default: CKPT_DIR/hf_assets when present)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="megatron-to-hf: dtype of the written tensors (default: the checkpoint's)")
    p.add_argument("--verify", action="store_true",
                   help="after converting, compare the Megatron model's logits with transformers' on the HF folder "
                        f"({VERIFY_SEQUENCES} fixed sequences x {VERIFY_TOKENS} tokens); print max |diff|, exit "
                        "non-zero above --verify-tolerance. Any TP/EP; needs PP=1")
    p.add_argument("--verify-tolerance", type=float, default=1e-5,
                   help="--verify: largest accepted max |logit difference| / max(1, max |logit|) (default 1e-5, "
                        "for float32 checkpoints; bf16/fp16 models need a looser one)")
    a = p.parse_args(argv)
    if a.verify and a.target_pipeline_model_parallel_size != 1:
        p.error("--verify needs --target-pipeline-model-parallel-size 1 (its forward runs on one stage; "
                "checkpoints reshard on load, so megatron-to-hf can always run at PP=1)")
    return a


def verify_logits(model, hf_dir: str, *, vocab_size: int, tolerance: float, label: str) -> float | None:
    """Compare ``model``'s logits (every rank of the model calls this: TP/EP collectives) with transformers' on
    ``hf_dir`` on fixed token sequences. Rank 0 prints one ``[tsync] verify:`` line and returns the max |diff|,
    or raises SystemExit with one line above ``tolerance``; other ranks return None."""
    import torch.distributed as dist

    from megatron_tsync.model.hf_conversion import transformers_logits
    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits, model_logits

    ids = torch.randint(0, vocab_size, (VERIFY_SEQUENCES, VERIFY_TOKENS),
                        generator=torch.Generator().manual_seed(0))  # (B, S)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        mine = gather_vocab_parallel_logits(model_logits(model, ids.to(device))).float().cpu()  # (B, S, V[+pad])
    model.train(was_training)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    ref = transformers_logits(hf_dir, ids)  # (B, S, V)
    mine = mine[..., : ref.shape[-1]]  # megatron may pad the vocabulary
    diff = (mine - ref).abs().max().item()
    scale = ref.abs().max().item()
    rel = diff / scale if scale > 0 else float("inf")
    measure = diff / max(1.0, scale)  # what --verify-tolerance bounds: fp32 rounding grows with the logits' scale
    what = (f"max |Δlogits| {diff:.3g} (relative {rel:.3g} of max |logit| {scale:.3g}; {label}, "
            f"{VERIFY_SEQUENCES} sequences × {VERIFY_TOKENS} tokens) against transformers on {hf_dir}")
    if not measure <= tolerance:  # also catches NaN
        low = "bf16" in label or "fp16" in label
        hint = "; bf16/fp16 weights and compute differ by their rounding: pass a looser --verify-tolerance" if low else ""
        raise SystemExit(f"[tsync] verify FAILED: {what} exceeds --verify-tolerance {tolerance:g}{hint}")
    print(f"[tsync] verify: {what}", flush=True)
    return measure


def _hf_to_megatron(a: argparse.Namespace) -> None:
    from megatron_tsync.training.checkpointing import save_checkpoint
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.builder import PrecisionConfig, build_model

    arch, state = load_hf_dir(a.load)
    dtype = next(iter(state.values())).dtype
    model = build_model(arch, PrecisionConfig(params_dtype=dtype, bf16=dtype == torch.bfloat16), seed=0)
    load_hf_into_model(model, state)
    del state
    save_checkpoint(a.save, 0, model, None, {"converted_from": os.path.abspath(a.load)}, hf_assets_src=a.load)
    if a.verify:  # the model as converted (and saved) against transformers on the source folder
        verify_logits(model, a.load, vocab_size=arch.vocab_size, tolerance=a.verify_tolerance,
                      label=_SHORT.get(dtype, str(dtype)))


def _megatron_to_hf(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from megatron_tsync.training import checkpointing as ck
    from megatron_tsync.model.hf_conversion import megatron_to_hf, save_hf_dir
    from megatron_tsync.model.builder import PrecisionConfig, build_model

    meta = ck.read_meta(a.load, a.step)
    arch = ck.arch_from_checkpoint(a.load, meta["step"])
    dtype = _DTYPES.get(meta.get("params_dtype", "float32"), torch.float32)
    model = build_model(arch, PrecisionConfig(params_dtype=dtype, bf16=dtype == torch.bfloat16), seed=0)
    ck.load_checkpoint(a.load, model, None, step=meta["step"], load_rng=False)
    state = megatron_to_hf(model)
    if a.dtype:
        state = {k: v.to(_DTYPES[a.dtype]) for k, v in state.items()}
    if dist.get_rank() == 0:
        tok = a.tokenizer
        if tok is None and os.path.isdir(os.path.join(a.load, ck.HF_ASSETS)):
            tok = os.path.join(a.load, ck.HF_ASSETS)
        save_hf_dir(a.save, state, arch, tokenizer_src=tok)
        print(f"wrote {a.save} ({len(state)} tensors) from {ck.iter_dir(a.load, meta['step'])}", flush=True)
    dist.barrier()
    if a.verify:  # the model exported from (in this process) against transformers on the written folder
        label = _SHORT.get(dtype, str(dtype))
        if a.dtype and _DTYPES[a.dtype] != dtype:
            label += f" model, {_SHORT[_DTYPES[a.dtype]]} export"
        del state
        verify_logits(model, a.save, vocab_size=arch.vocab_size, tolerance=a.verify_tolerance, label=label)


def run(a: argparse.Namespace) -> None:
    """Convert in this process (one rank of a launcher or of :func:`_spawn_local`)."""
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(a.target_tensor_parallel_size, a.target_pipeline_model_parallel_size,
                        ep=a.target_expert_model_parallel_size, seed=0)
    try:
        (_hf_to_megatron if a.direction == "hf-to-megatron" else _megatron_to_hf)(a)
    finally:
        destroy_parallel()


def _spawn_entry(rank: int, world: int, port: int, a: argparse.Namespace) -> None:
    # every rank a client of the parent's store (as under torchrun's agent): no rank binds a port of its own
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    run(a)


def main(argv=None) -> None:
    a = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = a.target_tensor_parallel_size * a.target_pipeline_model_parallel_size * a.target_expert_model_parallel_size
    launched = "WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ
    if launched or world == 1:
        if not launched:  # one process: an in-process store (model/parallel.py), no port
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        run(a)
    else:
        import torch.multiprocessing as mp
        from torch.distributed import TCPStore

        # the ranks' rendezvous store, bound here on port 0 before any rank starts: a port picked by bind-and-close
        # could be taken by another process before rank 0 bound it (the race torchrun --standalone avoids)
        store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False)
        try:
            mp.spawn(_spawn_entry, args=(world, store.port, a), nprocs=world, join=True)
        except mp.ProcessExitedException as e:  # a rank exited non-zero (e.g. --verify failed; it printed why)
            sys.exit(e.exit_code or 1)


if __name__ == "__main__":
    sys.exit(main())
