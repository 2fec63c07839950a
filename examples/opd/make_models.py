"""Make the teacher and the student for the OPD recipe (examples/opd/README.md).

Both start from the same tiny Llama (one tokenizer); the teacher gets a long supervised warm start on the arithmetic
calculator task, the student a short one:

    python examples/opd/make_models.py runs/opd --teacher-steps 300 --student-steps 120

writes runs/opd/teacher and runs/opd/student (Hugging Face folders). One CPU process.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def sft_to_dir(base: str, out: str, steps: int, *, lr: float = 1e-3, seed: int = 0) -> list[float]:
    """Load ``base``, ``steps`` supervised steps on the task's demonstrations, save to ``out`` (HF folder)."""
    from transformers import AutoTokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.training.sft import sft_warmup
    from megatron_tsync.runtime.tasks import get_task
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf, save_hf_dir
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    arch, state = load_hf_dir(base)
    model = build_model(arch, seed=seed)
    load_hf_into_model(model, state)
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, OptimConfig(optimizer="adam", lr=lr, clip_grad=1.0))
    codec = TokenizerCodec(AutoTokenizer.from_pretrained(base))
    losses = sft_warmup(ddp, opt, codec, get_task("arithmetic-calculator"), steps, batch_size=16, seed=seed) if steps else []
    save_hf_dir(out, megatron_to_hf(ddp), arch, tokenizer_src=base)
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--teacher-steps", type=int, default=300)
    ap.add_argument("--student-steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel
    from megatron_tsync.model.tiny_model import make_tiny_model

    initialize_parallel(1, 1, seed=a.seed)
    base = os.path.join(a.root, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        make_tiny_model(base, seed=a.seed)
    for name, steps in (("teacher", a.teacher_steps), ("student", a.student_steps)):
        t = time.perf_counter()
        losses = sft_to_dir(base, os.path.join(a.root, name), steps, seed=a.seed)
        msg = f"loss {losses[0]:.3f} → {losses[-1]:.3f}" if losses else "no warm start"
        print(f"[opd] {name}: {steps} supervised steps, {msg} ({time.perf_counter() - t:.0f}s) -> "
              f"{os.path.join(a.root, name)}", flush=True)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
