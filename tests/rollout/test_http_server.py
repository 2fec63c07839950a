"""The endpoint's HTTP transport under load, against a live :class:`ChatServer` on the tiny model's embedded engine:
a burst of 500 clients is all answered (served, or 503 + Retry-After; none reset), 1,000 idle half-open connections
neither delay a valid request nor pin a thread and are closed at the head deadline, a 30 MB prompt is refused before
it is read, and malformed HTTP gets 4xx. The measured figures are printed (the asserts carry generous margins).
"""

import asyncio
import json
import resource
import socket
import threading
import time
import tracemalloc

import pytest
import torch

from megatron_tsync.rollout.engine import SamplingConfig
from megatron_tsync.rollout.http_server import HttpLimits

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _fds():
    """Room for both ends of ~1,000 connections in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def parts(megatron_single, tiny_dir):
    from transformers import AutoTokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.openai_chat import ChatTemplate

    codec = TokenizerCodec(AutoTokenizer.from_pretrained(tiny_dir))
    return dict(engine=EmbeddedEngine.from_hf_dir(tiny_dir, detokenize=codec.decode), codec=codec,
                template=ChatTemplate.from_hf_dir(tiny_dir), eos=codec.encode("</s>")[0])


def _server(parts, codec=None, **kw):
    from megatron_tsync.rollout.openai_server import ChatServer

    sampling = SamplingConfig(max_new_tokens=4, stop_token_ids=(parts["eos"],), seed=3)
    return ChatServer(parts["engine"], codec or parts["codec"], parts["template"], sampling=sampling,
                      model_name="tiny", **kw)


class _CountingCodec:
    """The real codec, with the length of every text it tokenised kept (the witness that nothing huge was)."""

    def __init__(self, codec):
        self.codec, self.encoded = codec, []

    def encode(self, text):
        self.encoded.append(len(text))
        return self.codec.encode(text)

    def encode_text(self, text):
        self.encoded.append(len(text))
        return self.codec.encode_text(text)

    def decode(self, ids):
        return self.codec.decode(ids)


def _chat_request(episode: str, content: str = "hi", close: bool = True) -> bytes:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Episode-Id: {episode}\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n").encode() + body


def _parse(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


def _exchange(server, *data: bytes, timeout: float = 60.0) -> tuple[int, dict, dict]:
    """Send ``data`` on a fresh connection, read the answer until the server closes it."""
    with socket.create_connection(server.http.address, timeout=timeout) as s:
        for part in data:
            s.sendall(part)
        chunks = []
        while chunk := s.recv(1 << 16):
            chunks.append(chunk)
    return _parse(b"".join(chunks))


def test_burst_of_500_clients_all_answered(parts):
    """500 clients connect at once, then all send a completion: each gets 200 or a 503 with Retry-After (over the
    connection cap, or over the in-flight cap), none is reset or left without an answer."""
    limits = HttpLimits(max_connections=300, max_inflight=48, max_body_bytes=1 << 20,
                        max_connections_per_peer=300)  # one client address here; the per-peer cap: below

    async def burst(address):
        conns = await asyncio.gather(*[asyncio.open_connection(*address) for _ in range(500)])

        async def one(k, reader, writer):
            try:
                writer.write(_chat_request(f"burst-{k}"))
                await writer.drain()
                return _parse(await reader.read(-1))
            except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
                return type(e).__name__
            finally:
                writer.close()

        return await asyncio.gather(*[one(k, r, w) for k, (r, w) in enumerate(conns)])

    with _server(parts, limits=limits) as srv:
        t0 = time.perf_counter()
        results = asyncio.run(burst(srv.http.address))
        wall = time.perf_counter() - t0
        stats = dict(srv.http.stats)
        served = sum(1 for r in results if not isinstance(r, str) and r[0] == 200)
        busy = [r for r in results if not isinstance(r, str) and r[0] == 503]
        broken = [r for r in results if isinstance(r, str) or r[0] not in (200, 503)]
        episodes = len(srv.episodes)
    print(f"\n500-client burst: {served} served, {len(busy)} answered 503 + Retry-After, {len(broken)} reset/other "
          f"in {wall:.2f} s; server stats {stats}")
    assert not broken, broken[:5]
    assert served + len(busy) == 500 and served >= 1 and len(busy) >= 200  # 200 beyond the 300 connections
    assert all(r[1].get("retry-after") == "1" and r[2]["error"]["type"] == "server_busy" for r in busy)
    assert episodes == served  # every 200 is an episode; a 503 left nothing behind


def test_idle_half_open_connections_neither_delay_nor_pin(parts):
    """1,000 connections that send half a request head (or nothing) and stall: a valid completion is served while
    they are all held, no thread per connection is spent, and at the head deadline the half-sent ones get 408 and
    every one is closed."""
    limits = HttpLimits(header_timeout_s=3.0)
    with _server(parts, limits=limits) as srv:
        threads_before = threading.active_count()
        idle = []
        for k in range(1000):
            s = socket.create_connection(srv.http.address)
            if k % 2 == 0:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Le")
            idle.append(s)
        t_idle = time.perf_counter()
        assert _until(lambda: srv.http.open_connections >= 1000, 30)
        t0 = time.perf_counter()
        status, _, out = _exchange(srv, _chat_request("valid"))
        latency = time.perf_counter() - t0
        held, threads = srv.http.open_connections, threading.active_count()
        answers = []
        for s in idle:
            s.settimeout(30)
            answers.append(s.recv(4096))
            s.close()
        closed_after = time.perf_counter() - t_idle
        assert _until(lambda: srv.http.open_connections == 0, 30)
    print(f"\n1,000 idle half-open connections: valid completion in {latency * 1e3:.0f} ms while {held} connections "
          f"were open; threads {threads_before} -> {threads}; all closed {closed_after:.1f} s after they went idle "
          f"(head deadline {limits.header_timeout_s} s)")
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant"
    assert held >= 1000 and threads - threads_before < 10  # served while they were all held; no thread each
    assert latency < 10  # the issue's bound is 2 s; a generous margin for 2 busy CI cores
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers[0::2]) and set(answers[1::2]) == {b""}


def _until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_30mb_prompt_refused_before_it_is_read(parts):
    """A 30 MB prompt is over the body cap derived from max_context_tokens: 413 from its Content-Length, the body is
    drained unread (the client gets the answer, not a reset) and the server allocates almost nothing. A prompt under
    the body cap but over max_prompt_chars is refused (400) without tokenising."""
    prompt = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (30 << 20)}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(prompt)}\r\nX-Episode-Id: big\r\n\r\n").encode()
    with _server(parts) as srv:
        tracemalloc.start()
        try:
            t0 = time.perf_counter()
            status, _, out = _exchange(srv, head, prompt)
            wall = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        cap = srv.http.limits.max_body_bytes
    spy = _CountingCodec(parts["codec"])
    with _server(parts, codec=spy) as srv:
        spy.encoded.clear()
        text = "y " * (srv.max_prompt_chars // 2 + 1)
        data = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}]}).encode()
        st2, _, out2 = _exchange(srv, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: "
                                       f"{len(data)}\r\nX-Episode-Id: long\r\nConnection: close\r\n\r\n").encode()
                                 + data)
        refused_encodes = list(spy.encoded)
        st3, _, _ = _exchange(srv, _chat_request("short"))  # the control: a short prompt is tokenised and served
    print(f"\n30 MB prompt: {status} in {wall * 1e3:.0f} ms, server-side peak allocation {peak / 2**20:.2f} MiB "
          f"(body cap {cap / 2**20:.1f} MiB); {len(text)}-character prompt: {st2} without tokenising")
    assert status == 413 and "takes at most" in out["error"]["message"] and len(prompt) > cap
    assert peak < 50 << 20 and wall < 5  # the issue's bounds are 50 MB and 1 s
    assert st2 == 400 and out2["error"]["code"] == "context_length_exceeded" and "max_prompt_chars" in \
        out2["error"]["message"] and len(data) < cap
    assert refused_encodes == [] and st3 == 200 and 0 < max(spy.encoded) < 1000


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: nope\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 400),  # HTTP/1.1 without Host
    (b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n", 431),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"PUT /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 404),
    (b"HEAD /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 404),  # answered without a body
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n{}", 408),  # body stalls
], ids=["garbage", "bad-length", "no-host", "huge-head", "bad-chunk", "unknown-method", "head",
                                "stalled-body"])
def test_malformed_http_gets_4xx(parts, raw, status):
    with _server(parts, limits=HttpLimits(header_timeout_s=5.0, body_timeout_s=0.5)) as srv:
        got, _, out = _exchange(srv, raw, timeout=30)
    assert got == status and (out["error"]["message"] if not raw.startswith(b"HEAD") else out == {}), out


# ------------------------------------------------------------------------------------------------ hostile clients
# Each attack comes from 127.0.0.1; the valid client is another address, 127.0.0.2 (a second loopback address).

KEY = "k-test"


def _keyed_request(episode: str, key: str | None = KEY, messages=None, secret: str | None = None) -> bytes:
    body = json.dumps({"model": "tiny", "messages": messages or [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()
    auth = (f"Authorization: Bearer {key}\r\n" if key else "") + (f"X-Episode-Secret: {secret}\r\n" if secret else "")
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\nX-Episode-Id: {episode}\r\nConnection: close\r\n\r\n").encode() + body


def _from(server, source: str, data: bytes, timeout: float = 30.0) -> tuple[int, dict, float]:
    """Send ``data`` from the address ``source``; (status, body, seconds until the answer was complete)."""
    t0 = time.perf_counter()
    with socket.create_connection(server.http.address, timeout=timeout, source_address=(source, 0)) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(1 << 16):
            chunks.append(chunk)
    status, _, out = _parse(b"".join(chunks))
    return status, out, time.perf_counter() - t0


def _valid(server, episode: str, key: str | None = None) -> tuple[int, float]:
    """A completion of a new episode from the valid client's address: (status, seconds)."""
    status, _, seconds = _from(server, "127.0.0.2", _keyed_request(episode, key))
    return status, seconds


def _pipeliner(address, n: int = 2000, key: str | None = None) -> socket.socket:
    """A client with a 4 KiB receive buffer that pipelines ``n`` requests (4 KB answers: a 404 names the path) and
    never reads."""
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(address)

    def send():
        try:
            s.sendall((b"GET /" + b"x" * 4000 + b" HTTP/1.1\r\nHost: t\r\n" + auth + b"\r\n") * n)
        except OSError:  # the server aborted the connection (or the test closed it)
            pass

    threading.Thread(target=send, daemon=True).start()
    return s


def test_never_reading_pipeliner_is_cut_at_the_write_deadline(parts):
    """Two clients pipeline requests and never read their answers, on a server with 2 connection slots: each answer
    that cannot be written within write_timeout_s aborts its connection, so the slots come back and a valid client
    is served (before: both slots held for as long as the clients kept their sockets, every other client 503)."""
    limits = HttpLimits(max_connections=2, max_connections_per_peer=2, write_timeout_s=0.5)
    with _server(parts, limits=limits) as srv:
        t0 = time.perf_counter()
        attackers = [_pipeliner(srv.http.address) for _ in range(2)]
        try:
            assert _until(lambda: srv.http.stats["write_timeouts"] == 2, 30), srv.http.stats
            cut = time.perf_counter() - t0
            assert _until(lambda: srv.http.open_connections == 0, 10)
            status, seconds = _valid(srv, "valid")
        finally:
            for s in attackers:
                s.close()
    print(f"\nnever-reading pipeliners: both cut {cut:.2f} s after they started (write deadline 0.5 s); a valid "
          f"request then served in {seconds * 1e3:.0f} ms")
    assert status == 200 and seconds < 2


@pytest.mark.parametrize("n", [4, 1000], ids=["4-slots", "1000-slots"])
def test_unauthenticated_slow_bodies_refused_from_the_head(parts, n):
    """On a keyed server with n connection slots, n clients without the key send a request head announcing a 1 MB
    body and then stall: each is answered 401 from its head (before its body), its slot freed, and a keyed request
    from another address is served within 2 s (before: the key was checked after the body, so the n stalled bodies
    held every slot for body_timeout_s, 60 s, and everyone else got 503)."""
    limits = HttpLimits(max_connections=n, max_connections_per_peer=n, body_timeout_s=60.0)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\nX-Episode-Id: slow\r\n\r\n{\"model\"")
    with _server(parts, limits=limits, api_key=KEY) as srv:
        attackers = []
        try:
            for _ in range(n):
                s = socket.create_connection(srv.http.address)
                s.sendall(head)
                attackers.append(s)
            assert _until(lambda: srv.http.stats["head_refused"] == n, 30)  # every stalled body refused
            status, seconds = _valid(srv, "valid", KEY)
            answers = []
            for s in attackers:
                s.settimeout(10)
                answers.append(s.recv(4096))
        finally:
            for s in attackers:
                s.close()
        refused = srv.http.stats["head_refused"]
    print(f"\n{n} unauthenticated slow bodies: {sum(a.startswith(b'HTTP/1.1 401 ') for a in answers)} answered 401 "
          f"from the head; a keyed request from 127.0.0.2 served in {seconds * 1e3:.0f} ms")
    assert status == 200 and seconds < 2
    assert all(a.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in a for a in answers) and refused == n


@pytest.mark.parametrize("slots, conns", [(8, 50), (1000, 2000)], ids=["8-slots", "1000-slots"])
def test_one_peer_cannot_take_every_connection(parts, slots, conns):
    """One address opens ``conns`` connections and holds them: it gets half the slots (the default
    max_connections_per_peer), every further connection is answered 429 + Retry-After at once (before it sends
    anything) without taking a slot, and another address is served within 2 s (before: the one address held every
    slot, the others got 503)."""
    with _server(parts, limits=HttpLimits(max_connections=slots)) as srv:
        held = []
        try:
            for _ in range(conns):
                held.append(socket.create_connection(srv.http.address))
            assert _until(lambda: srv.http.stats["connections"] >= conns, 30)
            status, seconds = _valid(srv, "valid")
            refused = []
            for s in held[slots // 2:]:
                s.settimeout(10)
                refused.append(s.recv(4096))
            open_now = srv.http.open_connections
        finally:
            for s in held:
                s.close()
    print(f"\none address opening {conns} connections against {slots} slots: {slots // 2} held, "
          f"{sum(r.startswith(b'HTTP/1.1 429 ') for r in refused)} answered 429 at once; another address served in "
          f"{seconds * 1e3:.0f} ms")
    assert status == 200 and seconds < 2
    assert all(r.startswith(b"HTTP/1.1 429 ") and b"Retry-After: 1" in r for r in refused)
    assert open_now == slots // 2  # the 429s hold no slot


async def _episode_flood(address, n: int, connections: int = 16, source: str | None = None,
                         key: str | None = None) -> list[int]:
    """``n`` one-completion episodes (``flood-K``) over ``connections`` keep-alive connections; their statuses."""
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""

    async def one_connection(ids):
        reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0) if source else None)
        statuses = []
        for k in ids:
            writer.write(_chat_request(f"flood-{k}", close=False).replace(b"\r\n\r\n", b"\r\n" + auth + b"\r\n", 1))
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(v for k_, _, v in (x.partition(b":") for x in head.split(b"\r\n"))
                              if k_.lower() == b"content-length"))
            await reader.readexactly(length)
            statuses.append(int(head.split()[1]))
        writer.close()
        return statuses

    parts_ = await asyncio.gather(*[one_connection(range(c, n, connections)) for c in range(connections)])
    return [s for p in parts_ for s in p]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _flood_episodes(parts, n: int, cap: int) -> dict:
    """One address opens ``n`` episodes and never finishes them on a server holding at most ``cap``; another
    address's episode, opened first, survives, and its continuation and new episodes are served."""
    with _server(parts, max_episodes=cap) as srv:
        st, mine, _ = _from(srv, "127.0.0.2", _keyed_request("mine", None))
        rss0 = _rss_mib()
        t0 = time.perf_counter()
        statuses = asyncio.run(_episode_flood(srv.http.address, n))
        flood_s = time.perf_counter() - t0
        stats = srv.stats()
        rss = _rss_mib() - rss0
        turn2 = [{"role": "user", "content": "hi"}, mine["choices"][0]["message"], {"role": "user", "content": "more"}]
        st2, _, t_cont = _from(srv, "127.0.0.2", _keyed_request("mine", None, turn2, mine["tsync"]["episode_secret"]))
        st3, t_new = _valid(srv, "valid-new")
        gone, out_gone, _ = _from(srv, "127.0.0.1", _keyed_request("flood-0", None, turn2))
        finished = srv.finish("mine")
    return dict(st=st, statuses=statuses, stats=stats, rss=rss, st2=st2, t_cont=t_cont, st3=st3, t_new=t_new,
                gone=gone, out_gone=out_gone, finished=finished, flood_s=flood_s)


def _check_flood(r: dict, n: int, cap: int) -> None:
    s = r["stats"]
    print(f"\n{n} idle episodes from one address against max_episodes {cap}: flood in {r['flood_s']:.1f} s, "
          f"{s['episodes']} open (~{s['episode_bytes'] / 2**20:.2f} MiB), {s['episodes_evicted']} evicted, RSS "
          f"+{r['rss']:.0f} MiB; the other address: turn 2 of its episode in {r['t_cont'] * 1e3:.0f} ms, a new "
          f"episode in {r['t_new'] * 1e3:.0f} ms")
    assert r["st"] == 200 and set(r["statuses"]) == {200} and len(r["statuses"]) == n
    assert s["episodes"] <= cap and s["episodes_evicted"] == n + 1 - cap and s["episode_bytes"] < cap << 14
    assert r["st2"] == 200 and r["t_cont"] < 2 and len(r["finished"].turn_spans) == 2  # not evicted: not the top
    assert r["st3"] == 200 and r["t_new"] < 2
    assert r["gone"] == 410 and r["out_gone"]["error"]["code"] == "episode_evicted"


def test_episode_flood_evicts_the_flooders_own(parts):
    """150 episodes opened and never finished from one address, max_episodes 16: at most 16 stay open (the memory
    the server reports stays bounded), the evicted are the flooder's own least recently used ones (the other
    address's episode survives and continues), a continuation of an evicted episode is 410 with the reason
    (before: every episode stayed open forever)."""
    _check_flood(_flood_episodes(parts, 150, 16), 150, 16)


def test_idle_episode_expires_and_says_so(parts):
    """episode_idle_s: an episode without a request for that long is dropped, GET /v1/tsync/stats counts it (only
    with the key on a keyed server), and its continuation gets 410 episode_expired (before: kept forever)."""
    with _server(parts, episode_idle_s=0.2, api_key=KEY) as srv:
        st, out, _ = _from(srv, "127.0.0.2", _keyed_request("idle"))
        assert st == 200 and list(srv.episodes) == ["idle"]
        assert _until(lambda: srv.stats()["episodes"] == 0, 10)
        stats = b"GET /v1/tsync/stats HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        st_nokey, _, _ = _from(srv, "127.0.0.2", stats + b"\r\n")
        st_stats, metrics, _ = _from(srv, "127.0.0.2", stats + f"Authorization: Bearer {KEY}\r\n\r\n".encode())
        turn2 = [{"role": "user", "content": "hi"}, out["choices"][0]["message"], {"role": "user", "content": "more"}]
        gone, err, _ = _from(srv, "127.0.0.2", _keyed_request("idle", KEY, turn2))
    assert st_nokey == 401 and st_stats == 200 and metrics["episodes_expired"] == 1 and metrics["episodes"] == 0
    assert metrics["episode_bytes"] == 0 and metrics["http"]["connections"] >= 3
    assert gone == 410 and err["error"]["code"] == "episode_expired" and "0.2 s" in err["error"]["message"]


def _prober(srv, stop: threading.Event, log: list) -> None:
    """The valid client (127.0.0.2, with the key): one new episode after another until ``stop``, each finished."""
    k = 0
    while not stop.is_set():
        try:
            status, seconds = _valid(srv, f"probe-{k}", KEY)
        except OSError as e:
            status, seconds = type(e).__name__, float("inf")
        log.append((status, seconds))
        if status == 200:
            srv.finish(f"probe-{k}")
        k += 1


@pytest.mark.slow
def test_all_four_attacks_at_the_issues_sizes(parts):
    """The issue's sizes at once, on a keyed server with the default limits: from 127.0.0.1 a never-reading
    pipeliner (with the key), 1,000 unauthenticated slow bodies and 2,000 held connections; from 127.0.0.3 episodes
    opened and never finished: twice the default cap of open episodes in CI (2,048: ~4 CPU s per 1,000, the server's
    per-request work, so the issue's 10,000 cost ~40 CPU s), the issue's 10,000 with TSYNC_FULL_SWEEPS=1. A client
    at 127.0.0.2 keeps opening episodes throughout: every one served, each within 2 s; the open episodes stay at the
    cap and RSS bounded."""
    import os

    from megatron_tsync.rollout.episode_store import MAX_EPISODES

    full = os.environ.get("TSYNC_FULL_SWEEPS", "") not in ("", "0")
    n_flood = 10000 if full else 2 * MAX_EPISODES  # past the cap either way: the evictions are exercised

    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\nX-Episode-Id: slow\r\n\r\n{")
    stop, log, held = threading.Event(), [], []
    with _server(parts, api_key=KEY) as srv:
        rss0 = _rss_mib()
        probe = threading.Thread(target=_prober, args=(srv, stop, log), daemon=True)
        probe.start()
        try:
            held.append(_pipeliner(srv.http.address, key=KEY))  # a key holder
            for k in range(3000):
                s = socket.create_connection(srv.http.address)
                if k < 1000:
                    s.sendall(head)
                held.append(s)
            flood = asyncio.run(_episode_flood(srv.http.address, n_flood, source="127.0.0.3", key=KEY))
            stats = srv.stats()
        finally:
            stop.set()
            probe.join(60)
            for s in held:
                s.close()
        rss = _rss_mib() - rss0
    times = sorted(t for _, t in log)
    p99, worst = times[int(0.99 * len(times))], times[-1]
    print(f"\nall four attacks: {len(log)} valid requests from 127.0.0.2 during them, median "
          f"{times[len(times) // 2] * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms, slowest {worst * 1e3:.0f} ms; "
          f"flood: {stats['episodes']} open (~{stats['episode_bytes'] / 2**20:.1f} MiB), "
          f"{stats['episodes_evicted']} evicted; transport {stats['http']}; RSS +{rss:.0f} MiB")
    assert set(flood) == {200} and len(flood) == n_flood and len(log) >= 10 and {st for st, _ in log} == {200}
    assert stats["episodes_evicted"] >= n_flood - MAX_EPISODES
    assert p99 < 2 and worst < 10  # the issue's bound is 2 s; the slowest come during the burst of 3,000 connects
    assert stats["episodes"] <= MAX_EPISODES and stats["http"]["head_refused"] == 1000
    assert stats["http"]["peer_429"] >= 900 and rss < 500
