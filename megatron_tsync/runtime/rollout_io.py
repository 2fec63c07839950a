"""``--dump-rollouts`` / ``--replay-rollouts`` and ``--dump-grads``: the documented on-disk formats.

Rollout dump, one folder per step: ``DIR/step_{k:07d}/``

- ``rollouts.safetensors``: flat tensors over all trajectories of the step, concatenated in ARRIVAL order:
  ``token_ids`` (int64), ``loss_mask`` (float32, 1 = trained action token), ``behaviour_logp`` (float64,
  engine log-probs, 0 where not an action), and when present ``ref_logp`` / ``teacher_logp`` (float64).
- ``rollouts.json``: ``{"format": "tsync-rollouts-v1", "step", "policy_version", "group_size",
  "groups": [group ids in batch order], "trajectories": [{"traj_id", "group_id", "group_size", "reward",
  "policy_version", "arrival_index", "arrival_s", "offset", "length", "meta"}]}`` — ``offset``/``length`` index
  the flat tensors; ``arrival_index`` is the order in which rewards landed at the learner.

Gradient dump, one file per optimizer update (GRPO and OPD alike): the gradient after the explicit normalisation
and the DP reduction, before clipping, under Hugging Face parameter names (same dtype as the parameters: float64 in
``--params-dtype float64`` verification runs), plus a JSON file beside it with the step, the update's epoch and
minibatch, the divisor and the gradient norm. A step of one update (one minibatch, one epoch: OPD, and GRPO by
default) writes ``DIR/grad_step_{k:07d}.safetensors``; a step of several (``--num-minibatches`` /
``--ppo-epochs``) writes ``DIR/grad_step_{k:07d}_epoch_{e}_mb_{j}.safetensors`` per update and no
``grad_step_{k:07d}.safetensors``: each update's gradient is taken at other weights, so no one file is "the step's".
"""

from __future__ import annotations

import json
import os

import torch

from megatron_tsync.streaming.ready_queue import Sample

FORMAT = "tsync-rollouts-v1"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def dump_rollouts(root: str, step: int, samples: list[Sample], group_order: list[str]) -> str:
    from safetensors.torch import save_file

    d = step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    flat: dict[str, list[torch.Tensor]] = {"token_ids": [], "loss_mask": [], "behaviour_logp": []}
    opt = {k: [] for k in ("ref_logp", "teacher_logp")}
    rows, off = [], 0
    for i, s in enumerate(samples):
        T = s.token_ids.numel()
        flat["token_ids"].append(s.token_ids.long())
        flat["loss_mask"].append(s.loss_mask.float())
        beh = s.behaviour_logp if s.behaviour_logp is not None else torch.zeros(T, dtype=torch.float64)
        flat["behaviour_logp"].append(beh.double())
        for k in opt:
            v = getattr(s, k)
            opt[k].append(None if v is None else v.double())
        rows.append({"traj_id": s.traj_id, "group_id": s.group_id, "group_size": s.group_size, "reward": s.reward,
                     "policy_version": s.policy_version, "arrival_index": i, "arrival_s": s.arrival_s,
                     "offset": off, "length": T, "meta": _json_meta(s)})
        off += T
    tensors = {k: torch.cat(v).contiguous() for k, v in flat.items()}
    for i, s in enumerate(samples):  # router replay: (P, L, k) per trajectory, P varies
        if s.routing is not None:
            tensors[f"routing.{i}"] = s.routing.contiguous()
    for k, vs in opt.items():
        if vs and all(v is not None for v in vs):
            tensors[k] = torch.cat(vs).contiguous()
    save_file(tensors, os.path.join(d, "rollouts.safetensors"))
    meta = {"format": FORMAT, "step": step, "policy_version": samples[0].policy_version if samples else step,
            "group_size": samples[0].group_size if samples else 0, "groups": group_order, "trajectories": rows}
    tmp = os.path.join(d, "rollouts.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(d, "rollouts.json"))
    return d


def _json_meta(s: Sample) -> dict:
    """A sample's meta for the JSON index: the worker's scalars; the learner's tensors (π_θ0 log-probs with several
    minibatches) are working state, not part of the rollout."""
    return {k: v for k, v in (getattr(s, "meta", {}) or {}).items() if not torch.is_tensor(v)}


def load_rollouts(root: str, step: int) -> tuple[list[Sample], list[str]]:
    """Samples of a dumped step in their recorded arrival order, and the group ids in batch order."""
    from safetensors.torch import load_file

    d = step_dir(root, step)
    if not os.path.exists(os.path.join(d, "rollouts.json")):
        raise FileNotFoundError(f"--replay-rollouts: no dump for step {step} under {root} ({d}/rollouts.json)")
    with open(os.path.join(d, "rollouts.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{d}: unknown rollout dump format {meta.get('format')!r} (expected {FORMAT})")
    t = load_file(os.path.join(d, "rollouts.safetensors"))
    out = []
    for r in sorted(meta["trajectories"], key=lambda r: r["arrival_index"]):
        routing = t.get(f"routing.{r['arrival_index']}")
        sl = slice(r["offset"], r["offset"] + r["length"])
        out.append(Sample(
            traj_id=r["traj_id"], group_id=r["group_id"], group_size=r["group_size"],
            token_ids=t["token_ids"][sl].clone(), loss_mask=t["loss_mask"][sl].clone(), reward=float(r["reward"]),
            policy_version=r["policy_version"], behaviour_logp=t["behaviour_logp"][sl].clone(),
            ref_logp=t["ref_logp"][sl].clone() if "ref_logp" in t else None,
            teacher_logp=t["teacher_logp"][sl].clone() if "teacher_logp" in t else None,
            arrival_s=float(r.get("arrival_s", 0.0)), meta=r.get("meta", {}),
            routing=None if routing is None else routing.clone(),
        ))
    return out, list(meta["groups"])


def dumped_steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit())


def grads_to_hf(ddp_model) -> dict[str, torch.Tensor]:
    """The gradient in ``param.main_grad`` under HF names (collective over TP/PP like ``megatron_to_hf``).

    Uses the conversion's own name/layout mapping by presenting each gradient as the parameter's data for the
    duration of the call (restored afterwards).
    """
    from megatron_tsync.model.hf_conversion import megatron_to_hf

    saved = []
    params = [p for p in ddp_model.parameters() if getattr(p, "main_grad", None) is not None]
    try:
        for p in params:
            saved.append(p.data)
            p.data = p.main_grad.view_as(p).to(p.dtype)
        return megatron_to_hf(ddp_model)
    finally:
        for p, d in zip(params, saved):
            p.data = d


def grad_dump_stem(step: int, epoch: int = 0, minibatch: int = 0, *, epochs: int = 1, minibatches: int = 1) -> str:
    """The file stem of one update's gradient dump (module docstring): ``grad_step_{k:07d}`` for a step of one update,
    ``grad_step_{k:07d}_epoch_{e}_mb_{j}`` for update (e, j) of a step of ``epochs`` × ``minibatches`` updates."""
    stem = f"grad_step_{step:07d}"
    return stem if epochs * minibatches == 1 else f"{stem}_epoch_{epoch}_mb_{minibatch}"


def dump_grads(root: str, step: int, ddp_model, *, divisor: float, write: bool, epoch: int = 0, minibatch: int = 0,
               epochs: int = 1, minibatches: int = 1) -> None:
    """Writes the normalised gradient in ``main_grad`` (collective over TP/PP: every rank calls, ``write`` on one)."""
    from safetensors.torch import save_file

    g = grads_to_hf(ddp_model)
    if not write:
        return
    os.makedirs(root, exist_ok=True)
    stem = os.path.join(root, grad_dump_stem(step, epoch, minibatch, epochs=epochs, minibatches=minibatches))
    save_file({k: v.contiguous() for k, v in g.items()}, stem + ".safetensors")
    norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in g.values())))
    with open(stem + ".json", "w") as f:
        json.dump({"step": step, "epoch": epoch, "minibatch": minibatch, "epochs": epochs, "minibatches": minibatches,
                   "divisor": divisor, "grad_norm": norm, "names": sorted(g)}, f, indent=1)


def grad_dump_hook(root: str, step: int, learner, *, write: bool, epochs: int = 1, minibatches: int = 1):
    """``--dump-grads``: the learner's ``grad_hook`` for step ``step`` (GRPO's ``Learner``, ``OPDLearner``). It reads
    what the learner publishes before each barrier: ``last_divisor``, and with several updates per step
    ``last_update`` (epoch, minibatch)."""

    def hook(ddp_model) -> None:
        e, j = learner.last_update if epochs * minibatches > 1 else (0, 0)
        dump_grads(root, step, ddp_model, divisor=learner.last_divisor, write=write, epoch=e, minibatch=j,
                   epochs=epochs, minibatches=minibatches)

    return hook
