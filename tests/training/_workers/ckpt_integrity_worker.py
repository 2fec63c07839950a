"""Checkpoint integrity worker (run by tests/training/test_checkpointing.py, one process, rank 0 of 1).

--case damage: saves steps 1, 2, 3 with keep_last 2 (a real Megatron model + Adam, a training step between saves),
    then on copies of the checkpoint folder flips one bit / truncates / deletes a file of the latest checkpoint and
    loads: without fallback (the error must name the file; the model must be untouched) and with fallback (step 2
    must load, bitwise equal to what was saved at step 2). Control: the undamaged copy loads step 3.
--case enospc --root DIR: saves step 1 into DIR, then fills DIR's filesystem (a small tmpfs the test mounted) up to
    half a checkpoint, saves step 2 (must fail saying "no space left on device"), frees the space and loads step 1.
    ``--inject`` instead makes torch.save raise OSError(ENOSPC) halfway through its file (no tmpfs needed).
Writes a JSON result to --out (``--out.rank{r}`` under torchrun, ``--tp 2``: every rank must see the same error and
load the same fallback); the test asserts on it.
"""

import argparse
import errno
import json
import os
import shutil

import torch


def _model(hf):
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    arch, state = load_hf_dir(hf)
    model = build_model(arch, seed=1)
    load_hf_into_model(model, state)
    ddp = wrap_ddp(model)
    return arch, model, ddp, build_optimizer(ddp, OptimConfig(optimizer="adam", lr=1e-2, clip_grad=1.0))


def _train_step(arch, ddp, opt):
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.training.optimizer import finalize_and_scale

    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = -token_logprobs(ddp, torch.randint(0, arch.vocab_size, (2, 12))).mean()
    loss.backward()
    finalize_and_scale(ddp, 1.0)
    opt.step()


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _damage(d, how):
    """Damages one file of checkpoint directory ``d``; returns its path."""
    if how == "missing":
        path = os.path.join(d, "common.pt")
        os.remove(path)
        return path
    shards = sorted((os.path.getsize(os.path.join(d, f)), f) for f in os.listdir(d) if f.endswith(".distcp"))
    path = os.path.join(d, shards[-1][1])  # the largest tensor file
    with open(path, "r+b") as f:
        if how == "bitflip":
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x01]))
        else:  # truncate
            f.truncate(os.path.getsize(path) - 100)
    return path


def case_damage(a, res):
    from megatron_tsync.training import checkpointing as ck

    arch, model, ddp, opt = _model(a.hf)
    root = os.path.join(a.root, "ck")
    saved = {}
    for step in (1, 2, 3):
        _train_step(arch, ddp, opt)
        ck.save_checkpoint(root, step, ddp, opt, {"step": step}, keep_last=2)
        saved[step] = _params(model)
    res["kept"] = ck.saved_steps(root)
    with open(os.path.join(ck.iter_dir(root, 3), "tsync_checksums.json")) as f:
        listed = set(json.load(f)["files"])
    d3 = ck.iter_dir(root, 3)
    on_disk = {os.path.relpath(os.path.join(r, n), d3) for r, _, ns in os.walk(d3) for n in ns}
    res["manifest_complete"] = listed == on_disk - {"tsync_checksums.json"} and len(listed) > 3
    _train_step(arch, ddp, opt)  # the live model now differs from every checkpoint
    live = _params(model)
    res["control_step"] = ck.load_checkpoint(root, ddp, opt)[0]
    res["control_equal"] = _same(_params(model), saved[3])
    for how in ("bitflip", "truncate", "missing"):
        copy = os.path.join(a.root, f"ck-{how}")
        box = [None]
        if torch.distributed.get_rank() == 0:  # one copy, damaged once, then every rank loads it
            shutil.copytree(root, copy)
            box = [_damage(ck.iter_dir(copy, 3), how)]
        torch.distributed.broadcast_object_list(box, src=0)
        path = box[0]
        for k, v in model.named_parameters():
            v.data.copy_(live[k])
        try:
            ck.load_checkpoint(copy, ddp, opt)
            res[how] = {"raised": None}
        except ck.CheckpointCorrupt as exc:
            res[how] = {"raised": str(exc), "path": exc.path, "damaged": path,
                        "untouched": _same(_params(model), live)}
        step, state = ck.load_checkpoint(copy, ddp, opt, fallback=True)
        res[how].update(fallback_step=step, fallback_state=state, fallback_equal=_same(_params(model), saved[2]))


def _fill(root, leave):
    """A filler file taking all but ``leave`` bytes of ``root``'s filesystem."""
    free = shutil.disk_usage(root).free
    with open(os.path.join(root, "filler"), "wb") as f:
        left = free - leave
        while left > 0:
            n = min(left, 1 << 20)
            f.write(b"\0" * n)
            left -= n
    return os.path.join(root, "filler")


def case_enospc(a, res):
    from megatron_tsync.training import checkpointing as ck

    arch, model, ddp, opt = _model(a.hf)
    root = os.path.join(a.root, "ck")
    _train_step(arch, ddp, opt)
    ck.save_checkpoint(root, 1, ddp, opt, {"step": 1})
    saved = _params(model)
    size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(ck.iter_dir(root, 1)) for n in ns)
    res["ckpt_bytes"] = size
    _train_step(arch, ddp, opt)
    filler, real_save = None, torch.save
    if a.inject:
        def full_disk_save(obj, f, *args, **kw):  # writes half of the file, then the device is "full"
            real_save(obj, f, *args, **kw)
            if not isinstance(f, str):  # an in-memory buffer
                return
            n = os.path.getsize(f)
            with open(f, "r+b") as fh:
                fh.truncate(n // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f)

        torch.save = full_disk_save
    else:
        filler = _fill(a.root, size // 2)
    try:
        ck.save_checkpoint(root, 2, ddp, opt, {"step": 2})
        res["raised"] = None
    except ck.CheckpointSaveError as exc:
        res["raised"], res["disk_full"] = str(exc), exc.disk_full
    finally:
        torch.save = real_save
    if filler:
        os.remove(filler)
    res["latest"] = ck.latest_step(root)
    res["left"] = sorted(os.listdir(root))
    res["load_step"] = ck.load_checkpoint(root, ddp, opt)[0]
    res["load_equal"] = _same(_params(model), saved)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=["damage", "enospc"], required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--inject", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="damage case under torchrun: tensor-parallel size")
    a = p.parse_args()
    from megatron_tsync.model.parallel import destroy_parallel

    run_case(a)
    destroy_parallel()


def run_case(a):
    """One case (``a``: case, hf, root, out, inject, tp) in this process (also run by ckpt_resume_worker's resume
    launch, after its own jobs): layout TP = a.tp, seeds as in a launch of its own; writes the JSON result."""
    from megatron_tsync.model.parallel import initialize_parallel

    dims = initialize_parallel(a.tp, 1, seed=1234)
    res = {}
    (case_damage if a.case == "damage" else case_enospc)(a, res)
    with open(a.out if dims.world_size == 1 else f"{a.out}.rank{dims.rank}", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
