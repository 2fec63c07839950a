"""Pre-flight: the start-up mistakes a run can know about from its flags and files alone, checked right after the
flags are parsed and before anything expensive or lasting happens (torch.distributed, the model build, the ``--save``
lock, a checkpoint, a rollout worker).

What is checked (each failure is one :class:`PreflightError`, printed as one line):

* ``--model``: the folder has ``config.json`` (unless ``--init-tiny-model`` will create it) and a tokenizer the
  loader (``transformers.AutoTokenizer``, in the trainer and in every rollout worker) can read: ``tokenizer.json``,
  or ``tokenizer.model`` (SentencePiece), or ``vocab.json`` + ``merges.txt`` (BPE), or ``vocab.txt``; a
  ``tokenizer.json`` whose ids pass the model's ``vocab_size``; ``--ref-model`` / ``--teacher-model`` hold a
  ``config.json``;
* the layout against ``config.json``: TP divides the attention heads, the KV heads (megatron's query groups) and the
  vocabulary (the embedding is split by rows over TP; this project does not pad the vocabulary), PP divides the
  layers, EP the experts; with a known world size (``WORLD_SIZE`` / ``SLURM_NTASKS``) TP × PP × CP divides it and EP
  the ranks world / (TP × PP);
* ``--task`` / ``--verifier``: the task exists (``module:name`` imported), accepts the verifier, scores with it (or
  brings its own environment), and its prompt source can be read (a task file that is missing or does not parse);
* ``--wandb-project``: the ``wandb`` package is installed; TP × PP × CP > 1 without a launcher names torchrun;
* ``--trainer-cpus`` / ``--rollout-cpus``: each core exists and this process may use it (``runtime/affinity.py``'s
  own check, run here before anything else);
* ``--replay-rollouts``: a dump whose trajectories carry MoE routing (``routing.{i}``, recorded by a
  ``--moe-router-replay`` run) is replayed with ``--moe-router-replay`` (read from the safetensors headers only);
* ``--seq-length`` against the task's prompts (the first prompts of step 0, tokenised with ``tokenizer.json``; else
  estimated at 3 characters a token): the longest prompt, and a correct transcript of the task (its demonstration,
  tokenised segment by segment as the agent loop does), must fit — else every trajectory is cut before it answers
  and trains at reward 0; prompt + ``--max-turns`` × ``--max-new-tokens`` beyond it is a warning (the agent loop
  caps a trajectory at ``--seq-length``, so only long ones are cut).

:func:`run_preflight` prints ``[tsync] error: ...`` on stderr (rank 0 only; every rank runs the same checks) and exits
with code 2, without a traceback unless ``TSYNC_DEBUG=1``. Warnings are ``[tsync] warning: ...`` lines.

Imports neither megatron nor transformers (``tokenizers`` only, for the token counts).
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
from typing import Any, NoReturn

from megatron_tsync.model.launcher import launcher_env

__all__ = ["PreflightError", "check", "run_preflight", "fail", "tokenizer_overflow"]

_TOKENIZER_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
_PROMPTS = 8  # prompts of step 0 tokenised for the length check (cheap; group g does not depend on the count)


class PreflightError(Exception):
    """A check of this module failed; the message says what is wrong and what to do."""


def debug() -> bool:
    return os.environ.get("TSYNC_DEBUG", "") not in ("", "0")


def fail(err: BaseException | str, code: int = 2) -> NoReturn:
    """One ``[tsync] error: ...`` line on stderr (rank 0), then exit ``code``. ``TSYNC_DEBUG=1``: re-raise instead."""
    if debug() and isinstance(err, BaseException):
        raise err
    if launcher_env()[0] == 0:
        msg = " ".join(str(err).split()) or type(err).__name__
        print(f"[tsync] error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def run_preflight(cfg) -> list[str]:
    """:func:`check`, its warnings printed (rank 0); a failure is :func:`fail` (exit 2)."""
    try:
        warnings = check(cfg)
    except PreflightError as e:
        fail(e)
    if launcher_env()[0] == 0:
        for w in warnings:
            print(f"[tsync] warning: {w}", file=sys.stderr, flush=True)
    return warnings


def check(cfg, *, world_size: int | None = None) -> list[str]:
    """Every check of the module docstring on the run's ``TrainConfig``; returns warnings, raises PreflightError."""
    warnings: list[str] = []
    _check_cpus(cfg)
    _check_wandb(cfg)
    hf = _check_model(cfg)
    if hf is not None:
        _check_layout(cfg, hf, world_size if world_size is not None else launcher_env()[1])
        _check_router_replay(cfg, hf)
    _check_replay_routing(cfg)
    task = _check_task(cfg)
    _check_eval(cfg, task)
    if not cfg.logging.replay_rollouts:  # a replay reads no prompts
        prompts = _read_prompts(cfg, task)
        if hf is not None:
            warnings += _check_lengths(cfg, task, prompts)
    return warnings


def launched() -> bool:
    """Whether a launcher (torchrun, srun) started this process."""
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or "SLURM_PROCID" in os.environ


def _check_wandb(cfg) -> None:
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise PreflightError(f"--wandb-project {cfg.logging.wandb_project}: the wandb package is not installed "
                             "(pip install wandb), or drop --wandb-project (TensorBoard: --tensorboard-dir)")


def _check_cpus(cfg) -> None:
    from megatron_tsync.runtime import affinity

    for text, flag in ((cfg.parallel.trainer_cpus, "--trainer-cpus"), (cfg.rollout.cpus, "--rollout-cpus")):
        if text is not None:
            try:
                affinity.resolve(text, flag)
            except affinity.AffinityError as e:
                raise PreflightError(str(e)) from None


# ------------------------------------------------------------------------------------------------------ model
def _read_config(path: str, flag: str) -> dict:
    fn = os.path.join(path, "config.json")
    try:
        with open(fn) as f:
            cfg = json.load(f)
    except OSError as e:
        raise PreflightError(f"{flag} {path}: cannot read config.json ({e.strerror})") from None
    except ValueError as e:
        raise PreflightError(f"{flag} {path}: config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PreflightError(f"{flag} {path}: config.json must hold a JSON object")
    return cfg


def tokenizer_files(path: str) -> tuple[str, ...] | None:
    """The first complete set of tokenizer files in ``path`` (see the module docstring), or None."""
    for files in _TOKENIZER_SETS:
        if all(os.path.isfile(os.path.join(path, f)) for f in files):
            return files
    return None


def _check_model(cfg) -> dict | None:
    """``config.json`` of ``--model`` (None when ``--init-tiny-model`` will create the folder)."""
    path = cfg.model.path
    if not path:
        raise PreflightError("--model is required: a Hugging Face model folder (config.json, weights, tokenizer), "
                             "or a new folder with --init-tiny-model")
    for flag, other in (("--ref-model", cfg.model.ref_model), ("--teacher-model", cfg.rollout.teacher_model)):
        if other and not os.path.isfile(os.path.join(other, "config.json")):
            raise PreflightError(f"{flag} {other}: no config.json there (a Hugging Face model folder is expected)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        if cfg.model.init_tiny_model and not (os.path.isdir(path) and os.listdir(path)):
            return None  # created by the run
        if not os.path.exists(path):
            raise PreflightError(f"--model {path}: no such folder (give a Hugging Face model folder, or add "
                                 "--init-tiny-model to create a tiny random one there)")
        raise PreflightError(f"--model {path}: no config.json in the folder (is it a Hugging Face model folder? "
                             "--init-tiny-model creates a tiny one only in an empty or missing folder)")
    hf = _read_config(path, "--model")
    missing = [k for k in ("vocab_size", "num_hidden_layers", "num_attention_heads") if not isinstance(hf.get(k), int)]
    if missing:
        raise PreflightError(f"--model {path}: config.json lacks {', '.join(missing)} (a Llama/Qwen2/Qwen3 config "
                             "is expected)")
    files = tokenizer_files(path)
    if files is None:
        raise PreflightError(f"--model {path}: no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + "
                             "merges.txt): copy the tokenizer files of the model it came from into the folder")
    if files == ("tokenizer.json",):  # other formats: RunContext's check_tokenizer_fits, with transformers
        ids = _tokenizer(path).get_vocab(with_added_tokens=True).values()
        msg = tokenizer_overflow(path, len(ids), max(ids, default=-1), hf["vocab_size"])
        if msg:
            raise PreflightError(msg)
    return hf


def tokenizer_overflow(model_dir: str, n_tokens: int, top_id: int, vocab_size: int) -> str | None:
    """The one rule for a tokenizer against the model's embedding (here and ``validation.check_tokenizer_fits``):
    an id ``>= vocab_size`` would index past the embedding rows. The message, or None when it fits."""
    if top_id < vocab_size:
        return None
    return (f"--model {model_dir}: the tokenizer has {n_tokens} tokens (ids up to {top_id}) but the model's "
            f"vocabulary has {vocab_size} (config.json vocab_size): ids >= {vocab_size} would index past the "
            "embedding. Use the tokenizer the model was trained with, or resize the model's embeddings")


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from tokenizers import Tokenizer

        try:
            _TOKENIZERS[path] = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
            raise PreflightError(f"--model {path}: tokenizer.json does not load ({e})") from None
    return _TOKENIZERS[path]


def _check_layout(cfg, hf: dict, world: int | None) -> None:
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep = p.expert_model_parallel_size
    where = f"--model {cfg.model.path} (config.json)"
    heads, vocab = hf["num_attention_heads"], hf["vocab_size"]
    kv = hf.get("num_key_value_heads") or heads
    fit = [d for d in range(1, min(heads, kv) + 1) if heads % d == 0 and kv % d == 0 and vocab % d == 0]
    tp_fit = f"; TP sizes that fit: {', '.join(map(str, fit))}"
    rules = [
        (heads % tp, f"--tensor-model-parallel-size {tp} does not divide the {heads} attention heads of {where}"
                     + tp_fit),
        (kv % tp, f"--tensor-model-parallel-size {tp} does not divide the {kv} key/value heads of {where}" + tp_fit),
        (vocab % tp, f"--tensor-model-parallel-size {tp} does not divide the vocabulary of {where} ({vocab} tokens; "
                     "the embedding is split by rows, not padded)" + tp_fit),
        (hf["num_hidden_layers"] % pp, f"--pipeline-model-parallel-size {pp} does not divide the "
                                       f"{hf['num_hidden_layers']} layers of {where}"),
    ]
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if experts:
        rules.append((experts % ep, f"--expert-model-parallel-size {ep} does not divide the {experts} experts of "
                                    f"{where}"))
    if world:
        launch = ("" if launched() else f": launch one process per rank, e.g. `torchrun --nproc-per-node "
                  f"{tp * pp * cp} -m megatron_tsync.train ...` (or srun)")
        rules.append((world % (tp * pp * cp), f"the {world} processes are not a multiple of TP × PP × CP = "
                                              f"{tp} × {pp} × {cp}{launch}"))
        rules.append(((world // (tp * pp)) % ep, f"--expert-model-parallel-size {ep} does not divide the "
                                                 f"data-parallel × context-parallel ranks of the {world} processes "
                                                 f"(world / (TP × PP) = {world // (tp * pp)})"))
    for bad, msg in rules:
        if bad:
            raise PreflightError(msg)


def _check_router_replay(cfg, hf: dict) -> None:
    """--moe-router-replay: a MoE model, and an engine that records routing here (the vLLM adapter's own refusal,
    asked now rather than when the rollout workers build their engines; skipped when vLLM is not installed in the
    trainer's environment, i.e. on external rollout nodes)."""
    if not cfg.model.moe_router_replay:
        return
    if not (hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")):  # GLM: n_routed
        raise PreflightError(f"--moe-router-replay needs a MoE model; --model {cfg.model.path} (config.json) has no "
                             "experts")
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is not None:
        from megatron_tsync.rollout import vllm_compat

        reason = vllm_compat.routed_experts_refusal()
        if reason:
            raise PreflightError(f"--moe-router-replay with --rollout-engine vllm: {reason}; use --rollout-engine "
                                 "embedded for router replay here")


def _safetensors_keys(path: str) -> list[str]:
    """The tensor names of a safetensors file, from its header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def _check_replay_routing(cfg) -> None:
    """A dump with routing replayed without --moe-router-replay: refused. Its gradient was taken with the recorded
    experts; without the flag the model routes by itself (another gradient than the recorded run's, silently), and
    the learner could not replay routing anyway (the model is built without megatron's ``RouterReplay``)."""
    root = cfg.logging.replay_rollouts
    if not root or cfg.model.moe_router_replay or not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        fn = os.path.join(root, name, "rollouts.safetensors")
        if not (name.startswith("step_") and os.path.isfile(fn)):
            continue
        try:
            routed = sum(k.startswith("routing.") for k in _safetensors_keys(fn))
        except (OSError, ValueError, struct.error):
            continue  # a damaged dump is the loader's to report, with its step
        if routed:
            raise PreflightError(
                f"--replay-rollouts {root}: {name} carries MoE routing for {routed} trajectories (routing.{{i}}, "
                "recorded with --moe-router-replay); add --moe-router-replay to replay them with the recorded experts")


# ------------------------------------------------------------------------------------------------------ task
def _check_task(cfg):
    from megatron_tsync.runtime.tasks import task_from_config

    name, verifier = cfg.rollout.task, cfg.rollout.verifier
    try:
        task = task_from_config(cfg.rollout)
    except KeyError as e:
        raise PreflightError(f"--task {name}: {e.args[0] if e.args else e}") from None
    except ImportError as e:
        if name.startswith("reasoning-gym:"):  # an optional dependency, not a module of the task's name
            raise PreflightError(f"--task {name}: {e}") from None
        raise PreflightError(f"--task {name}: cannot import {name.partition(':')[0]} ({e}); a 'module:task' name "
                             "needs the module importable from the working directory") from None
    except (TypeError, ValueError) as e:
        raise PreflightError(f"--task {name} with --verifier {verifier}: {e}") from None
    own = getattr(task, "verifier", verifier)
    if own != verifier:
        raise PreflightError(f"--task {name} scores with verifier {own!r} but --verifier is {verifier!r}: pass "
                             f"--verifier {own} (or a task that accepts {verifier!r})")
    if not hasattr(task, "make_environment"):  # the worker builds the verifier by name
        from megatron_tsync.rollout.verifiers import get_verifier

        try:
            get_verifier(own, **getattr(task, "verifier_kwargs", {}))
        except (KeyError, TypeError, ValueError) as e:
            raise PreflightError(f"--verifier {own} (task {name}): {e.args[0] if e.args else e}") from None
    return task


def _check_eval(cfg, task) -> None:
    """``--eval-interval``: a layout where rank 0 holds the whole policy, and a task with a held-out split."""
    if not cfg.logging.eval_interval:
        return
    from megatron_tsync.runtime.evaluation import eval_layout_error

    err = eval_layout_error(cfg)
    if err:
        raise PreflightError(err)
    try:
        task.sample_prompts(0, 1, cfg.rl.seed, split="eval")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PreflightError(f"--eval-interval: task {cfg.rollout.task} gives no held-out prompts "
                             f"(sample_prompts(..., split='eval')): {e}") from None


def _read_prompts(cfg, task) -> list:
    """The first prompts of step 0 (up to ``_PROMPTS``): the task's prompt source exists and parses."""
    try:
        return task.sample_prompts(0, min(cfg.rl.groups_per_step, _PROMPTS), cfg.rl.seed)
    except (OSError, ValueError, KeyError) as e:
        raise PreflightError(f"--task {cfg.rollout.task}: cannot read its prompts: {e}") from None


def _check_lengths(cfg, task, prompts) -> list[str]:
    path = cfg.model.path
    tok = _tokenizer(path) if tokenizer_files(path) == ("tokenizer.json",) else None

    def count(text: str) -> int:
        if tok is None:
            return max(1, len(text) // 3)  # no tokenizer.json: ~3 characters a token
        return len(tok.encode(text, add_special_tokens=False).ids)

    rl = cfg.rl
    how = "" if tok is not None else " (estimated at 3 characters a token: no tokenizer.json)"
    longest = max(count(inst.prompt_text) for inst in prompts)
    if longest >= rl.seq_length:
        raise PreflightError(f"--seq-length {rl.seq_length} is too short: the task's prompts take up to {longest} "
                             f"tokens{how}, leaving nothing to generate; raise --seq-length to at least "
                             f"{longest + rl.max_turns * rl.max_new_tokens} (prompt + --max-turns {rl.max_turns} × "
                             f"--max-new-tokens {rl.max_new_tokens})")
    segments = getattr(task, "demonstration_segments", None)  # a task without reference solutions: nothing to compare
    try:
        demo = max(sum(count(text) for text, _ in segments(inst)) for inst in prompts) if segments else 0
    except (KeyError, ValueError, NotImplementedError):  # instances without a reference solution
        demo = 0
    if demo > rl.seq_length:
        raise PreflightError(f"--seq-length {rl.seq_length} is too short for a correct answer: the task's reference "
                             f"transcripts take up to {demo} tokens{how}, so every trajectory would be cut before it "
                             f"answers and score 0; raise --seq-length to at least {demo} (prompt + --max-turns "
                             f"{rl.max_turns} × --max-new-tokens {rl.max_new_tokens} = "
                             f"{longest + rl.max_turns * rl.max_new_tokens})")
    need = longest + rl.max_turns * rl.max_new_tokens
    if need > rl.seq_length:
        return [f"--seq-length {rl.seq_length} < prompt ({longest} tokens{how}) + --max-turns {rl.max_turns} × "
                f"--max-new-tokens {rl.max_new_tokens} = {need}: a trajectory that uses every turn is cut at "
                "--seq-length (tool output counts too)"]
    return []
