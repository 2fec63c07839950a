"""An OpenAI-compatible chat-completions endpoint on top of any :class:`RolloutEngine`, so a user's own agent harness
drives an episode while the rollout side keeps the exact tokens and log-probs the learner trains on.

Endpoints (HTTP/1.1 on ``rollout/http_server.py``: asyncio + h11; bind port 0 for a free port)::

    GET  /v1/models                         the served model, as NAME and NAME@vVERSION
    POST /v1/chat/completions               one completion of an episode (OpenAI request/response format)
    POST /v1/episodes/{id}/finish           end the episode, get its trajectory (body: {"verify_s", "metadata"})
    DELETE /v1/episodes/{id}                drop an episode
    GET  /v1/tsync/stats                    the server's metrics: open episodes and their approximate memory,
                                            evictions and expiries, the transport's counters

Episode identity: the ``X-Episode-Id`` header, else the request's ``user`` field (one is required). The first
completion of an episode renders its messages with the chat template; every later request must repeat the
conversation so far (the server's replies included) and may only add tool / user / system messages, which are
appended as tokens with loss mask 0 after the exact sampled tokens (``rollout/openai_chat.py`` explains how). The
request's strings are encoded as plain text: a message that prints ``</s>`` or ``<|im_end|>`` never becomes a special
token id (``openai_chat``'s module docstring).

Policy versions: every completion is stamped with the engine's ``policy_version`` (response field
``tsync.policy_version``). ``model`` may pin a version as ``NAME@vN`` (or the ``X-Policy-Version`` header): another
version is refused (409). An episode is sampled by one version: once the engine's weights change, the episode's next
completion is refused (409) and the harness must finish it (the trajectory so far is whole) and start a new one.

Sampling: the server's :class:`SamplingConfig` (the run's temperature, top-k/top-p, per-turn cap) is the one the
learner assumes for its log-probs; with ``fixed_sampling=True`` (default) a request asking for another temperature or
top_p is refused (400) and ``max_tokens`` may only lower the cap; with ``fixed_sampling=False`` requests choose, and
the trajectory's ``metadata["temperatures"]`` says which temperature sampled each turn. Penalties, logit_bias, n > 1
and streaming are always refused. Tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of
the generated text become OpenAI ``tool_calls`` (finish_reason "tool_calls").

Batching: concurrent requests (of different episodes) are handed to ONE ``engine.generate`` call on the engine
thread (those waiting when it frees up, plus any arriving within ``batch_wait_s``), grouped by sampling parameters;
each request keeps its own seed and cap (a completion sampled under a larger cap is cut at its own, which is the
sample the smaller cap gives), so batched results equal one-at-a-time ones. An episode serves one request at a time
(a concurrent one gets 409). Latency trace: with ``trace_path`` every finished episode appends
one JSON line (rollout, generation, harness/tool and verification seconds; ``rollout/latency_trace.py``), which
``trace-to-profile`` turns into a ``--latency-profile`` file.

Access: with ``api_key`` every request must send ``Authorization: Bearer API_KEY`` (401 otherwise, answered from
the request head before its body is read, and the connection closed); a non-loopback
``host`` without a key is refused at construction (the CLI prints one line and exits 2). Episode ownership: an
episode is bound to the credential of the request that opened it -- its ``X-Episode-Secret`` header if it sent one,
else its bearer token (an ``openai`` client's ``api_key``), else a secret the server generates and returns as the
``X-Episode-Secret`` response header and ``tsync.episode_secret``. Its later completions, ``/finish`` and ``DELETE``
must present that credential (either header), else 403. In-process calls (:meth:`ChatServer.finish`, ``abort``,
``handle``, ``chat_completion``) are trusted: no key, any episode (``handle(..., trusted=False)`` checks as HTTP does). With a shared ``api_key`` every key holder presents the same bearer token: clients that must not touch each
other's episodes send their own ``X-Episode-Secret``.

Limits (every refusal is an OpenAI-style JSON error, nothing is left behind): the transport's
:class:`~megatron_tsync.rollout.http_server.HttpLimits` (connection and in-flight caps answered 503 + ``Retry-After``,
head/body read deadlines 408, a body cap 413 checked on ``Content-Length`` before reading; by default ``8 *
max_prompt_chars + 1 MiB``), then ``max_prompt_chars`` (default ``CHARS_PER_TOKEN_CAP * max_context_tokens``) on the
request's text before anything is tokenised (400 ``context_length_exceeded``), then ``max_context_tokens`` on the
tokens. Bodies that are not JSON objects of Unicode text (invalid UTF-8, lone surrogates, NaN, nesting deeper than
``MAX_JSON_DEPTH``) and wrongly typed fields are 400. Open episodes are bounded by ``max_episodes`` (LRU eviction,
fair between client addresses) and ``episode_idle_s`` (``rollout/episode_store.py``); a request continuing an evicted
or expired episode gets 410.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import signal
import sys
import threading
import time
import zlib
from typing import Any

from megatron_tsync.rollout.agent_loop import ToolCallRecord, Trajectory
from megatron_tsync.rollout.chat_batcher import EngineBatcher
from megatron_tsync.rollout.engine import RolloutEngine, SamplingConfig, derive_seed
from megatron_tsync.rollout.episode_store import EPISODE_IDLE_S, MAX_EPISODES, EpisodeStore, approx_bytes
from megatron_tsync.rollout.http_server import PEER_HEADER, HttpLimits, HttpServer
from megatron_tsync.rollout.latency_trace import LatencyTrace, latency_profile_from_trace
from megatron_tsync.rollout.openai_chat import (
    ApiError, ChatTemplate, encode_rendered, first_difference, normalize_messages, normalize_tools, parse_json_body,
    parse_tool_calls,
)

__all__ = ["ChatServer", "Episode", "HttpLimits", "chat_limits", "trajectory_to_json", "trajectory_event",
           "latency_profile_from_trace", "is_loopback"]

CHARS_PER_TOKEN_CAP = 32
"""``max_prompt_chars`` defaults to this many characters per context token (no tokenizer's prompts average more)."""
_REFUSED_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias")


def chat_limits(max_context_tokens: int, max_prompt_chars: int | None = None, **overrides) -> HttpLimits:
    """The endpoint's default transport limits: :class:`HttpLimits` with ``max_body_bytes`` = 8 bytes per prompt
    character + 1 MiB (JSON escapes take up to 6 bytes a character); ``overrides``: other fields."""
    chars = int(max_prompt_chars or CHARS_PER_TOKEN_CAP * max_context_tokens)
    return HttpLimits(**{"max_body_bytes": 8 * chars + (1 << 20), **overrides})


@dataclasses.dataclass
class Episode:
    """The token record of one harness-driven episode (``Trajectory`` fields, built up per completion)."""

    id: str
    index: int
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_len: int = 0
    turn_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    turn_versions: list[int] = dataclasses.field(default_factory=list)
    observations: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    credential: bytes = b""
    """SHA-256 of the credential that opened the episode (X-Episode-Secret or bearer token); b"": in-process."""
    messages: list[dict] = dataclasses.field(default_factory=list)
    """The conversation so far as the server saw it, ending with its own last reply."""
    tools: list[dict] | None = None
    closed: bool = False
    """Whether the last completion generated the end-of-turn marker itself."""
    policy_version: int = -1
    finish_reason: str | None = None
    t_start: float = 0.0
    t_reply: float = 0.0
    generate_s: list[float] = dataclasses.field(default_factory=list)
    temperatures: list[float] = dataclasses.field(default_factory=list)
    peer: str = ""
    """The client address key of the request that opened it ("" in-process); ``rollout/episode_store.py``."""
    t_used: float = 0.0
    """``time.monotonic()`` of its last request."""
    approx_bytes: int = 0

    def trajectory(self, metadata: dict | None = None) -> Trajectory:
        return Trajectory(
            index=self.index, token_ids=list(self.token_ids), prompt_len=self.prompt_len,
            loss_mask=list(self.loss_mask), logprobs=list(self.logprobs), turn_spans=list(self.turn_spans),
            turn_versions=list(self.turn_versions), tool_calls=list(self.observations),
            finish_reason=self.finish_reason, policy_version=self.policy_version,
            metadata={"episode_id": self.id, **(metadata or {})},
        )


def trajectory_to_json(traj: Trajectory) -> dict:
    """The JSON form of a trajectory (what ``/finish`` returns)."""
    d = dataclasses.asdict(traj)
    d.pop("routing", None)
    d["turn_spans"] = [list(s) for s in traj.turn_spans]
    return d


def trajectory_event(traj: Trajectory, *, group_id: str, index: int, group_size: int, reward: float,
                     status: str = "ok", error: str = ""):
    """The transport ``TrajectoryEvent`` of a finished episode (what a rollout worker sends the learner): the exact
    token ids, loss mask and behaviour log-probs (0 off the mask), turn spans and the episode's policy version."""
    import numpy as np

    from megatron_tsync.transport import TrajectoryEvent
    from megatron_tsync.transport.ids import traj_id

    mask = np.asarray(traj.loss_mask, dtype=np.uint8)
    meta = {k: v for k, v in traj.metadata.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}
    return TrajectoryEvent(
        traj_id=traj_id(group_id, index), group_id=group_id, group_size=group_size,
        policy_version=traj.policy_version, token_ids=np.asarray(traj.token_ids, dtype=np.int32),
        prompt_len=traj.prompt_len, loss_mask=mask, logprobs=np.asarray(traj.logprobs, dtype=np.float32) * mask,
        reward=float(reward), turn_spans=[tuple(s) for s in traj.turn_spans], status=status, error=error,
        meta={**meta, "finish": traj.finish_reason or "", "turns": traj.num_turns},
    )


def _model_and_version(model: Any) -> tuple[str, int | None]:
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string (NAME or NAME@vVERSION, see GET /v1/models)", "model")
    m = re.fullmatch(r"(.*)@v(\d+)", model)
    return (m.group(1), int(m.group(2))) if m else (model, None)


class ChatServer:
    """The endpoint (see the module docstring).

    Args:
        engine: any :class:`RolloutEngine`. Multi-token end-of-turn markers are stop strings, so an engine that
            stops on strings (the embedded engine built with ``detokenize=...``) is needed then.
        codec: the policy tokenizer (:class:`TokenizerCodec`).
        template: chat template + end-of-turn marker (:meth:`ChatTemplate.from_hf_dir`).
        sampling: the run's sampling; ``stop_token_ids`` (EOS) stay, the end-of-turn marker is added.
        model_name: the name clients put in ``model``.
        max_context_tokens: cap on an episode's total tokens (prompt + completions + observations).
        fixed_sampling: refuse requests for another temperature / top_p (see the module docstring).
        trace_path: JSONL latency trace, one line per finished episode (None: no trace).
        batch_wait_s: how long the engine thread waits for more requests before a batched ``generate``.
        host, port: where to listen (port 0: a free one). A non-loopback host needs ``api_key``.
        api_key: every request must send ``Authorization: Bearer API_KEY`` (401 otherwise); None: no key.
        max_prompt_chars: cap on a completion request's text (all JSON strings), checked before tokenising;
            default ``CHARS_PER_TOKEN_CAP * max_context_tokens``.
        limits: the HTTP transport's limits (:class:`HttpLimits`); default: its defaults with ``max_body_bytes`` =
            8 bytes per prompt character + 1 MiB (JSON escapes take up to 6 bytes a character).
        tool_parser: ``(text, id_prefix) -> (content, tool_calls)`` of a completion's text (default
            :func:`parse_tool_calls`, Qwen-style ``<tool_call>`` JSON; ``rollout/tag_chat.py`` has the agent loop's
            ``<tool>NAME: ARGS</tool>`` format).
        max_episodes: open episodes at most (at the cap one is evicted, see ``rollout/episode_store.py``); None:
            no cap.
        episode_idle_s: an episode without a request for this long is dropped; None: never.
    """

    def __init__(self, engine: RolloutEngine, codec, template: ChatTemplate, *, sampling: SamplingConfig,
                 model_name: str = "tsync-policy", max_context_tokens: int = 4096, fixed_sampling: bool = True,
                 trace_path: str | None = None, batch_wait_s: float = 0.002, host: str = "127.0.0.1",
                 port: int = 0, api_key: str | None = None, max_prompt_chars: int | None = None,
                 limits: HttpLimits | None = None, tool_parser=None, max_episodes: int | None = MAX_EPISODES,
                 episode_idle_s: float | None = EPISODE_IDLE_S):
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise ValueError("api_key must be a non-empty string (or None for no key)")
        if api_key is None and not is_loopback(host):
            raise ValueError(non_loopback_refusal(host))
        self.api_key = api_key
        self.engine, self.codec, self.template = engine, codec, template
        self.tool_parser = tool_parser or parse_tool_calls
        self.model_name = model_name
        self.max_context_tokens = int(max_context_tokens)
        self.max_prompt_chars = int(max_prompt_chars or CHARS_PER_TOKEN_CAP * self.max_context_tokens)
        if limits is None:
            limits = chat_limits(self.max_context_tokens, self.max_prompt_chars)
        self.fixed_sampling = bool(fixed_sampling)
        self.trace = None if trace_path is None else LatencyTrace(trace_path)
        eot = codec.encode(template.end_of_turn)
        if len(eot) == 1:
            sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids) + (eot[0],))
        else:
            if getattr(engine, "detokenize", True) is None:
                raise ValueError(f"the end-of-turn marker {template.end_of_turn!r} is {len(eot)} tokens for this "
                                 f"tokenizer: the engine must stop on strings (EmbeddedEngine(detokenize=...))")
            stops = tuple(sampling.stop_strings) + (template.end_of_turn,)
            sampling = dataclasses.replace(sampling, stop_strings=stops)
        self.sampling = sampling
        self.store = EpisodeStore(max_episodes, episode_idle_s)
        self.episodes: dict[str, Episode] = self.store.episodes  # least recently used first
        self._lock = self.store.lock
        self._count = 0
        self._batcher = EngineBatcher(engine, batch_wait_s)
        try:
            self.http = HttpServer(self.respond, host, port, limits,
                                   check_head=None if api_key is None else self._check_head)
        except BaseException:
            self._batcher.close()
            raise

    @classmethod
    def from_hf_dir(cls, engine: RolloutEngine, model_dir: str, *, sampling: SamplingConfig | None = None,
                    end_of_turn: str | None = None, **kwargs) -> "ChatServer":
        """Tokenizer and chat template of a Hugging Face folder; EOS (``generation_config.json``) as stop token."""
        from transformers import AutoTokenizer

        from megatron_tsync.model.tokenizer import TokenizerCodec

        tok = AutoTokenizer.from_pretrained(model_dir)
        if sampling is None:
            sampling = SamplingConfig(stop_token_ids=() if tok.eos_token_id is None else (tok.eos_token_id,))
        return cls(engine, TokenizerCodec(tok), ChatTemplate.from_hf_dir(model_dir, end_of_turn=end_of_turn),
                   sampling=sampling, **kwargs)

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        host, port = self.http.address
        return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"

    def start(self) -> "ChatServer":
        self.http.start()
        return self

    def close(self) -> None:
        self.http.close()
        self._batcher.close()

    def __enter__(self) -> "ChatServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def served_model(self) -> str:
        return f"{self.model_name}@v{self.engine.policy_version}"

    # ------------------------------------------------------------------ routing (no sockets: testable directly)
    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes, *,
               trusted: bool = True) -> tuple[int, dict]:
        """One HTTP request -> (status, JSON body). Never raises: bad requests are 4xx, failures 500. In-process
        callers are ``trusted`` like :meth:`finish` (no API key, any episode); ``trusted=False`` checks both as the
        HTTP transport does."""
        return self.respond(method, path, headers, body, trusted=trusted)[:2]

    def respond(self, method: str, path: str, headers: dict[str, str], body: bytes, *,
                trusted: bool = False) -> tuple[int, dict, dict]:
        """What the HTTP transport calls: :meth:`handle` with the response headers (``X-Episode-Secret``,
        ``WWW-Authenticate``); untrusted by default."""
        try:
            headers = {k.lower(): v for k, v in headers.items()}
            if not trusted:
                self._authorize(headers)
            with self._lock:
                self.store.expire()
            out = self._route(method, path.split("?", 1)[0].rstrip("/"), headers, body, trusted)
            secret = out.get("tsync", {}).get("episode_secret")
            return 200, out, ({"X-Episode-Secret": secret} if secret else {})
        except ApiError as e:
            return e.status, e.body(), ({"WWW-Authenticate": "Bearer"} if e.status == 401 else {})
        except Exception as e:  # a server bug answers 500 with its reason; the server keeps serving
            return 500, ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), {}

    def _check_head(self, method: str, path: str, headers: dict[str, str]) -> tuple | None:
        """The transport's check of a request head, before its body is read: the API key."""
        try:
            self._authorize({k.lower(): v for k, v in headers.items()})
        except ApiError as e:
            return e.status, e.body(), {"WWW-Authenticate": "Bearer"}
        return None

    def stats(self) -> dict:
        """The server's metrics (``GET /v1/tsync/stats``): open episodes, their approximate memory (bytes), episodes
        evicted / expired / finished / deleted, and the transport's counters and open connections."""
        http = self.http
        return {**self.store.stats(), "http": {**http.stats, "open_connections": http.open_connections,
                                               "closing": http.closing, "inflight": http.inflight,
                                               "peers": len(http.peers)}}

    def _authorize(self, headers: dict[str, str]) -> None:
        if self.api_key is None:
            return
        token = _bearer(headers)
        if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (the server's --api-key)",
                           None, "invalid_api_key")

    def _route(self, method: str, path: str, headers: dict[str, str], body: bytes, trusted: bool) -> dict:
        if method == "GET" and path == "/v1/models":
            return self.models()
        if method == "GET" and path == "/v1/tsync/stats":
            return self.stats()
        if method == "POST" and path == "/v1/chat/completions":
            req, chars = parse_json_body(body)
            if chars > self.max_prompt_chars:  # before any tokenising: a huge prompt costs no more than its bytes
                raise ApiError(400, f"the request's text is {chars} characters; this server takes at most "
                                    f"{self.max_prompt_chars} (max_prompt_chars, refused before tokenising)",
                               "messages", "context_length_exceeded")
            return self.chat_completion(req, headers, trusted=trusted)
        m = re.fullmatch(r"/v1/episodes/([^/]+)(/finish)?", path)
        if m and method in ("POST", "DELETE") and not trusted:
            self._check_owner(m.group(1), headers)
        if m and method == "POST" and m.group(2):
            req = parse_json_body(body)[0] if body.strip() else {}
            if not isinstance(req, dict):
                raise ApiError(400, "the finish body must be a JSON object {verify_s, metadata}")
            verify_s = req.get("verify_s")
            if verify_s is not None and (not isinstance(verify_s, (int, float)) or isinstance(verify_s, bool)):
                raise ApiError(400, "'verify_s' must be a number of seconds", "verify_s")
            meta = req.get("metadata") or {}
            if not isinstance(meta, dict):
                raise ApiError(400, "'metadata' must be an object", "metadata")
            return trajectory_to_json(self.finish(m.group(1), verify_s=verify_s, metadata=meta))
        if m and method == "DELETE" and not m.group(2):
            self.abort(m.group(1))
            return {"deleted": m.group(1)}
        raise ApiError(404, f"no endpoint {method} {path}; see GET /v1/models, POST /v1/chat/completions, "
                            f"POST /v1/episodes/ID/finish, DELETE /v1/episodes/ID, GET /v1/tsync/stats")

    def _check_owner(self, episode_id: str, headers: dict[str, str]) -> None:
        """403 unless the request presents the credential that opened the episode (a missing one is 404 later)."""
        with self._lock:
            ep = self.episodes.get(episode_id)
        if ep is not None and ep.credential and not any(
                hmac.compare_digest(_digest(c), ep.credential) for c in _credentials(headers)):
            raise ApiError(403, f"episode {episode_id!r} was opened by another client: repeat the credential that "
                                f"opened it (its X-Episode-Secret header, or the same API key)", None,
                           "episode_not_owned")

    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "megatron_tsync",
             "policy_version": self.engine.policy_version}
            for name in (self.model_name, self.served_model)]}

    # ------------------------------------------------------------------ episodes
    def finish(self, episode_id: str, *, verify_s: float | None = None, metadata: dict | None = None) -> Trajectory:
        """End an episode: its trajectory (agent-loop fields; ``metadata`` added); appends its latency trace line."""
        with self._lock:
            ep = self.episodes.get(episode_id)
            if ep is None:
                self.store.check_gone(episode_id)
                raise ApiError(404, f"no episode {episode_id!r} (never completed, finished, or deleted)")
            if not ep.lock.acquire(blocking=False):
                raise ApiError(409, f"episode {episode_id!r} has a request in flight; finish it afterwards")
            self.store.drop(episode_id, "finished")
        try:
            traj = ep.trajectory(metadata)
        finally:
            ep.lock.release()
        rollout_s = ep.t_reply - ep.t_start
        traj.metadata.update(rollout_s=rollout_s, generate_s=list(ep.generate_s), temperatures=list(ep.temperatures))
        if verify_s is not None:
            traj.metadata["verify_s"] = float(verify_s)
        if self.trace is not None:
            self.trace.append({"episode_id": ep.id, "group": str(traj.metadata.get("group", ep.id)),
                               "index": ep.index, "policy_version": ep.policy_version, "turns": len(ep.turn_spans),
                               "rollout_s": rollout_s, "generate_s": list(ep.generate_s),
                               "tool_s": [o.wall_s for o in ep.observations],
                               "verify_s": None if verify_s is None else float(verify_s)})
        return traj

    def abort(self, episode_id: str) -> None:
        with self._lock:
            if self.store.drop(episode_id, "deleted") is None:
                self.store.check_gone(episode_id)
                raise ApiError(404, f"no episode {episode_id!r}")

    def _episode(self, episode_id: str, headers: dict[str, str], trusted: bool,
                 continues: bool) -> tuple[Episode, bool, str | None]:
        """(the episode, whether this request opens it, the secret generated for it when the opener sent no
        credential). An existing episode is only served to the credential that opened it. ``continues``: the request
        carries assistant turns (a gone episode's continuation is refused, 410)."""
        creds, secret = _credentials(headers), None
        with self._lock:
            ep = self.episodes.get(episode_id)
            if ep is None:
                ep = self.store.open(episode_id, lambda: Episode(episode_id, self._count), headers.get(PEER_HEADER, ""),
                                     continues)
                self._count += 1
                if not creds:
                    creds = [secret := secrets.token_urlsafe(24)]
                ep.credential = _digest(creds[0])
            elif not trusted and not any(hmac.compare_digest(_digest(c), ep.credential) for c in creds):
                raise ApiError(403, f"episode {episode_id!r} was opened by another client: repeat the credential "
                                    f"that opened it (its X-Episode-Secret header, or the same API key)", None,
                               "episode_not_owned")
            if not ep.lock.acquire(blocking=False):
                raise ApiError(409, f"episode {episode_id!r} already has a request in flight (one at a time)")
            self.store.touch(ep)
            return ep, not ep.turn_spans, secret

    # ------------------------------------------------------------------ chat completions
    def chat_completion(self, body: Any, headers: dict[str, str], *, trusted: bool = True) -> dict:
        """One completion (``body`` parsed, ``headers`` lower-case); ``trusted``: see :meth:`handle`."""
        t_arrive = time.perf_counter()
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        name, pinned = _model_and_version(body.get("model"))
        if name != self.model_name:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {self.served_model!r}",
                           "model", "model_not_found")
        if "x-policy-version" in headers:
            try:
                pinned = int(headers["x-policy-version"])
            except ValueError:
                raise ApiError(400, "the X-Policy-Version header must be an integer") from None
        episode_id = headers.get("x-episode-id") or body.get("user")
        if not isinstance(episode_id, str) or not episode_id or len(episode_id) > 256 or "/" in episode_id:
            raise ApiError(400, "name the episode: an X-Episode-Id header or the 'user' field (1-256 characters, "
                                "no '/')", "user")
        messages = normalize_messages(body.get("messages"))
        tools = normalize_tools(body.get("tools"))
        sampling, seed = self._sampling(body)
        want_logprobs = self._check_options(body)
        if pinned is not None and pinned != self.engine.policy_version:
            raise ApiError(409, f"policy version v{pinned} requested, the engine serves v{self.engine.policy_version}",
                           "model", "policy_version_mismatch")
        ep, new, secret = self._episode(episode_id, headers, trusted, any(m["role"] == "assistant" for m in messages))
        try:
            comp, prompt, obs = self._generate(ep, new, messages, tools, sampling, seed, pinned, t_arrive)
            reply = self._record(ep, new, messages, tools, comp, prompt, obs, t_arrive)
            ep.temperatures.append(sampling.temperature)
        finally:
            with self._lock:
                if new and not ep.turn_spans:  # a refused first request leaves no episode behind
                    if self.episodes.get(episode_id) is ep:
                        self.store.drop(episode_id)
                else:
                    self.store.touch(ep, approx_bytes(len(ep.token_ids), len(json.dumps(ep.messages)),
                                                      len(ep.messages)))
            ep.lock.release()
        out = self._response(ep, comp, reply, len(prompt), want_logprobs)
        if secret is not None:
            out["tsync"]["episode_secret"] = secret
        return out

    def _sampling(self, body: dict) -> tuple[SamplingConfig, int | None]:
        base = self.sampling
        kw: dict[str, Any] = {}
        for field, name in (("temperature", "temperature"), ("top_p", "top_p")):
            v = body.get(name)
            if v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ApiError(400, f"'{name}' must be a number", name)
            if self.fixed_sampling and float(v) != getattr(base, field):
                raise ApiError(400, f"this server samples with {name}={getattr(base, field)} (the learner's "
                                    f"log-probs assume it); the request asks for {v}", name)
            kw[field] = float(v)
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap is not None:
            if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
                raise ApiError(400, "'max_tokens' must be an integer >= 1", "max_tokens")
            kw["max_new_tokens"] = min(cap, base.max_new_tokens) if self.fixed_sampling else cap
        stop = body.get("stop")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
                raise ApiError(400, "'stop' must be a string or a list of non-empty strings", "stop")
            kw["stop_strings"] = tuple(base.stop_strings) + tuple(stop)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63):
            raise ApiError(400, "'seed' must be an integer in [0, 2**63)", "seed")
        try:
            return dataclasses.replace(base, **kw), seed
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    @staticmethod
    def _check_options(body: dict) -> bool:
        if body.get("stream"):
            raise ApiError(400, "streaming responses are not supported; send stream=false", "stream")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported (one completion per request)", "n")
        for name in _REFUSED_FIELDS:
            if body.get(name):
                raise ApiError(400, f"'{name}' is not supported: it would change the sampling distribution the "
                                    f"learner's log-probs assume", name)
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise ApiError(400, "tool_choice must be 'auto' or 'none' (forcing a tool is not supported)", "tool_choice")
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise ApiError(400, "only response_format {'type': 'text'} is supported", "response_format")
        if body.get("top_logprobs"):
            raise ApiError(400, "top_logprobs is not supported (the sampled token's log-prob is)", "top_logprobs")
        return bool(body.get("logprobs"))

    def _prompt(self, ep: Episode, new: bool, messages: list[dict], tools) -> tuple[list[int], list[int]]:
        """(context tokens, the appended observation tokens) for this request."""
        if new:
            if messages[-1]["role"] == "assistant":
                raise ApiError(400, "the last message is an assistant message: nothing for the model to answer",
                               "messages")
            return encode_rendered(self.codec, self.template.render_marked(messages, tools, True), messages, tools), []
        if tools != ep.tools:
            raise ApiError(409, "'tools' differ from the episode's first request (they are part of its prompt)",
                           "tools")
        why = first_difference(ep.messages, messages)
        if why is not None:
            raise ApiError(409, f"the messages do not extend episode {ep.id!r}: {why}", "messages")
        added = messages[len(ep.messages):]
        for k, m in enumerate(added):
            if m["role"] == "assistant":
                raise ApiError(409, f"messages[{len(ep.messages) + k}] is an assistant message this server did not "
                                    f"generate: an episode's assistant turns must be its completions", "messages")
        obs = encode_rendered(self.codec, self.template.continuation(messages[:len(ep.messages)], messages, tools,
                                                                      ep.closed), added, None)
        return list(ep.token_ids) + obs, obs

    def _generate(self, ep, new, messages, tools, sampling, seed, pinned, t_arrive):
        prompt, obs = self._prompt(ep, new, messages, tools)
        if not new and self.engine.policy_version != ep.policy_version:
            raise ApiError(409, f"the policy weights changed mid-episode (episode {ep.id!r} was sampled by "
                                f"v{ep.policy_version}, the engine now serves v{self.engine.policy_version}): finish "
                                f"this episode and start a new one", "model", "policy_version_changed")
        room = self.max_context_tokens - len(prompt)
        if room < 1:
            raise ApiError(400, f"context full: {len(prompt)} tokens, max_context_tokens {self.max_context_tokens}",
                           "messages", "context_length_exceeded")
        sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
        turn = len(ep.turn_spans)
        if seed is None and sampling.seed is not None:
            seed = derive_seed(sampling.seed, zlib.crc32(ep.id.encode()), turn)
        try:
            comp = self._batcher.generate(prompt, sampling, seed)
        except ValueError as e:  # the engine's own argument checks (prompt too long for the model, ...)
            raise ApiError(400, f"engine refused the request: {e}") from None
        want = ep.policy_version if not new else pinned
        if want is not None and comp.policy_version != want:
            raise ApiError(409, f"the weights changed while this completion was sampled (v{comp.policy_version}, "
                                f"expected v{want}); the completion is discarded", "model", "policy_version_changed")
        return comp, prompt, obs

    def _record(self, ep: Episode, new: bool, messages, tools, comp, prompt, obs, t_arrive) -> dict:
        now = time.perf_counter()
        if new:
            ep.token_ids, ep.loss_mask, ep.logprobs = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
            ep.prompt_len, ep.tools, ep.policy_version, ep.t_start = len(prompt), tools, comp.policy_version, t_arrive
        else:
            start = len(ep.token_ids)
            ep.token_ids += obs
            ep.loss_mask += [0] * len(obs)
            ep.logprobs += [0.0] * len(obs)
            calls = {c["id"]: c["function"] for c in ep.messages[-1].get("tool_calls", ())}
            added = [calls.get(m.get("tool_call_id"), {"name": m.get("name") or m["role"], "arguments": None})
                     for m in messages[len(ep.messages):]]
            ep.observations.append(ToolCallRecord(
                len(ep.turn_spans) - 1, ",".join(a["name"] for a in added),
                json.dumps([a["arguments"] for a in added]), True, None, (start, len(ep.token_ids)),
                t_arrive - ep.t_reply))
        start = len(ep.token_ids)
        ep.token_ids += comp.token_ids
        ep.loss_mask += [1] * len(comp.token_ids)
        ep.logprobs += [float(x) for x in comp.logprobs]
        ep.turn_spans.append((start, len(ep.token_ids)))
        ep.turn_versions.append(comp.policy_version)
        ep.generate_s.append(now - t_arrive)
        text = self.codec.decode(comp.token_ids)
        eot = text.rfind(self.template.end_of_turn)
        ep.closed = eot >= 0
        body = text[:eot] if eot >= 0 else text
        eos = [self.codec.decode([t]) for t in self.sampling.stop_token_ids if comp.token_ids[-1:] == [t]]
        if eos and not ep.closed and body.endswith(eos[0]) and eos[0] not in self.template.kept_stops:
            body = body[: len(body) - len(eos[0])]
        content, calls = self.tool_parser(body, f"call_{ep.index}_{len(ep.turn_spans) - 1}")
        reply = {"role": "assistant", "content": content or None}
        if calls:
            reply["tool_calls"] = calls
        ep.finish_reason = "tool_calls" if calls else ("length" if comp.finish_reason == "length" else "stop")
        ep.messages = messages + normalize_messages([reply])
        ep.t_reply = time.perf_counter()
        return reply

    def _response(self, ep: Episode, comp, reply: dict, prompt_len: int, want_logprobs: bool) -> dict:
        turn = len(ep.turn_spans) - 1
        choice: dict[str, Any] = {"index": 0, "message": reply, "finish_reason": ep.finish_reason, "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = {"content": [
                {"token": (s := self.codec.decode([t])), "logprob": float(lp), "bytes": list(s.encode()),
                 "top_logprobs": []} for t, lp in zip(comp.token_ids, comp.logprobs)]}
        return {
            "id": f"chatcmpl-{ep.index}-{turn}", "object": "chat.completion", "created": int(time.time()),
            "model": f"{self.model_name}@v{comp.policy_version}", "choices": [choice],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(comp.token_ids),
                      "total_tokens": prompt_len + len(comp.token_ids)},
            "tsync": {"episode_id": ep.id, "turn": turn, "policy_version": comp.policy_version,
                      "completion_token_ids": list(comp.token_ids), "context_tokens": len(ep.token_ids)},
        }


# ------------------------------------------------------------------------------------------------ HTTP


def _bearer(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _credentials(headers: dict[str, str]) -> list[str]:
    """What a request presents as its client identity, in order: ``X-Episode-Secret``, the bearer token."""
    return [c for c in (headers.get("x-episode-secret", "").strip() or None, _bearer(headers)) if c]


def _digest(credential: str) -> bytes:
    return hashlib.sha256(credential.encode("utf-8", "surrogatepass")).digest()


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def non_loopback_refusal(host: str) -> str:
    return (f"refusing to serve on {host!r} without an API key: anyone who can reach it could sample and read or end "
            f"episodes; set --api-key KEY (or TSYNC_API_KEY), or bind 127.0.0.1")


# ------------------------------------------------------------------------------------------------ command line


def _serve_main(a) -> int:
    import socket

    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel
    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    if "MASTER_PORT" not in os.environ:  # the embedded engine is a private single-process megatron group
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    initialize_parallel(1, 1, seed=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    codec = TokenizerCodec(tok)
    engine = EmbeddedEngine.from_hf_dir(a.model, detokenize=codec.decode)
    sampling = SamplingConfig(temperature=a.temperature, top_k=a.top_k, max_new_tokens=a.max_new_tokens,
                              stop_token_ids=() if tok.eos_token_id is None else (tok.eos_token_id,))
    server = ChatServer(engine, codec, ChatTemplate.from_hf_dir(a.model), sampling=sampling, model_name=a.model_name,
                        max_context_tokens=a.max_context_tokens, trace_path=a.trace, host=a.host, port=a.port,
                        api_key=a.api_key, **_server_limits(a))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with server:
            print(f"serving {server.url} (model {server.served_model})", flush=True)
            stop.wait()
    finally:  # gloo groups left to interpreter teardown can abort the process (exit -6 seen once in CI)
        destroy_parallel()
    return 0


def _server_limits(a) -> dict:
    """The ``serve`` flags' limits as :class:`ChatServer` keyword arguments (0 turns a cap off)."""
    return dict(limits=chat_limits(a.max_context_tokens, max_connections=a.max_connections,
                                   max_connections_per_peer=(a.max_connections if a.max_connections_per_peer == 0
                                                             else a.max_connections_per_peer),
                                   write_timeout_s=a.write_timeout),
                max_episodes=a.max_episodes or None, episode_idle_s=a.episode_idle_timeout or None)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_tsync.rollout.openai_server", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve --model on the embedded engine until SIGINT/SIGTERM")
    s.add_argument("--model", required=True, help="Hugging Face folder (weights, tokenizer, optional chat template)")
    s.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs --api-key")
    s.add_argument("--api-key", default=os.environ.get("TSYNC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every request (default: $TSYNC_API_KEY)")
    s.add_argument("--max-connections", type=int, default=HttpLimits.max_connections,
                   help="open connections served at once; more are answered 503 + Retry-After")
    s.add_argument("--max-connections-per-peer", type=int, default=None,
                   help="open connections one client address (an IPv6 client: its /64) may hold; more are answered "
                        "429 + Retry-After at once (default: half of --max-connections; 0: no per-address cap)")
    s.add_argument("--write-timeout", type=float, default=HttpLimits.write_timeout_s,
                   help="seconds to write an answer; a client that does not read it in time is disconnected")
    s.add_argument("--max-episodes", type=int, default=MAX_EPISODES,
                   help="open episodes at most; at the cap the least recently used idle episode of the client "
                        "holding the most is evicted (0: no cap)")
    s.add_argument("--episode-idle-timeout", type=float, default=EPISODE_IDLE_S,
                   help="seconds an episode may go without a request before it is dropped (0: never)")
    s.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    s.add_argument("--model-name", default="tsync-policy", help="the name clients put in 'model'")
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--max-new-tokens", type=int, default=256, help="per-completion cap (requests may lower it)")
    s.add_argument("--max-context-tokens", type=int, default=4096)
    s.add_argument("--trace", default=None, help="append each finished episode's latencies to this JSONL file")
    t = sub.add_parser("trace-to-profile", help="write a --latency-profile JSON replaying JSONL traces")
    t.add_argument("trace", nargs="+", help="JSONL trace files (this server's --trace, rollout workers' traces)")
    t.add_argument("--out", required=True, help="the profile JSON to write")
    t.add_argument("--no-verify", action="store_true", help="leave the verification seconds out of the replay")
    return p


def main(argv=None) -> int:
    """``serve``: a Hugging Face folder on the embedded engine (CPU); ``trace-to-profile``: a JSONL latency trace to a
    ``--latency-profile`` JSON file."""
    a = _parser().parse_args(argv)
    if a.cmd == "serve":
        a.api_key = a.api_key or None
        if a.api_key is None and not is_loopback(a.host):
            print(f"error: {non_loopback_refusal(a.host)}", file=sys.stderr)
            return 2
        return _serve_main(a)
    try:
        profile = latency_profile_from_trace(a.trace, include_verify=not a.no_verify)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(a.out, "w") as f:
        json.dump(profile, f)
    print(f"{a.out}: {sum(len(v) for v in profile['groups'].values())} trajectories in {len(profile['groups'])} groups")
    return 0


if __name__ == "__main__":
    sys.exit(main())
