"""The OpenAI-compatible endpoint: a user's harness drives a 3-turn tool-use episode through the ``openai`` client;
the trajectory is token-exact (trained tokens = sampled tokens, observations appended as tokens with mask 0),
its log-probs equal the trainer's, wrong policy versions are refused, bad requests get 4xx, never a crash.

The tiny Llama is first taught the episode (a few Adam steps on its exact token sequence) so that it really emits
Qwen-style ``<tool_call>`` JSON at temperature 0.7; every completion is still sampled by the embedded engine.
"""

import json
import urllib.error
import urllib.request

import pytest
import torch

torch.set_num_threads(1)

from megatron_tsync.rollout.engine import SamplingConfig  # noqa: E402
from megatron_tsync.rollout.openai_chat import ChatTemplate, normalize_messages, normalize_tools  # noqa: E402

ATOL = 1e-5
TEMPERATURE = 0.7
SYSTEM = "Use calc."
QUESTION = "(12+7*3)*2?"
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
    "e": {"type": "string"}}}}}]
CALLS = ["12+7*3", "33*2"]
FINAL = "The answer is 66."


def _call_text(expr: str) -> str:
    return '<tool_call>{"name": "calc", "arguments": {"e": "%s"}}</tool_call><|im_end|>' % expr


class RecordingEngine:
    """The real engine, with every (prompt, completion) it produced kept as the witness of what was sampled."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def policy_version(self):
        return self.engine.policy_version

    def generate(self, prompts, sampling, n=1, *, seeds=None):
        out = self.engine.generate(prompts, sampling, n, seeds=seeds)
        self.calls.extend((list(p), o[0]) for p, o in zip(prompts, out))
        self.sampling, self.batch_sizes = sampling, getattr(self, "batch_sizes", []) + [len(prompts)]
        return out

    def update_weights(self, state, version):
        self.engine.update_weights(state, version)


def _script_tokens(codec, template):
    """The token sequence the server builds when the model emits the scripted turns: (ids, generated mask)."""
    tools = normalize_tools(TOOLS)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = codec.encode(template.render(normalize_messages(msgs), tools, True))
    mask = [0] * len(ids)
    results = {"12+7*3": "33", "33*2": "66"}
    for k, text in enumerate([_call_text(e) for e in CALLS] + [FINAL + "<|im_end|>"]):
        gen = codec.encode(text)
        ids, mask = ids + gen, mask + [1] * len(gen)
        if k == len(CALLS):
            break
        reply = {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{k}", "type": "function", "function": {
            "name": "calc", "arguments": json.dumps({"e": CALLS[k]})}}]}
        seen = normalize_messages(msgs + [reply])
        msgs = msgs + [reply, {"role": "tool", "tool_call_id": f"c{k}", "content": results[CALLS[k]]}]
        obs = codec.encode(template.continuation(seen, normalize_messages(msgs), tools, True))
        ids, mask = ids + obs, mask + [0] * len(obs)
    return ids, mask


def _teach(model, ids, mask, *, steps=300):
    """Adam on the scripted sequence until the model's most likely next token is the script's at every generated
    position (greedy decoding then replays the episode)."""
    from megatron_tsync.model.logprobs import model_logits

    x = torch.tensor([ids])
    m, target = torch.tensor(mask[1:], dtype=torch.bool), x[0, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        logits = model_logits(model, x)[0, :-1]  # (T-1, V)
        if (logits.argmax(-1) == target)[m].all():
            break
        opt.zero_grad()
        torch.nn.functional.cross_entropy(logits[m], target[m]).backward()
        opt.step()
    else:
        raise AssertionError(f"the tiny model did not learn the episode in {steps} steps")
    model.eval()
    return step


@pytest.fixture(scope="module")
def base(megatron_single, tiny_dir):
    """Codec, template, the tiny model's weights and a (recording) embedded engine on them."""
    from transformers import AutoTokenizer

    from megatron_tsync.model.hf_conversion import load_hf_dir
    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    codec = TokenizerCodec(AutoTokenizer.from_pretrained(tiny_dir))
    arch, state = load_hf_dir(tiny_dir)
    engine = EmbeddedEngine.from_hf_dir(tiny_dir, detokenize=codec.decode)
    return dict(codec=codec, template=ChatTemplate.from_hf_dir(tiny_dir), arch=arch, state=state,
                engine=RecordingEngine(engine), eos=codec.encode("</s>")[0])


@pytest.fixture(scope="module")
def taught(base):
    """A trainer model taught the scripted episode, and its weights (Megatron names)."""
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_into_model

    trainer = build_model(base["arch"], seed=1)
    load_hf_into_model(trainer, base["state"])
    steps = _teach(trainer, *_script_tokens(base["codec"], base["template"]))
    weights = {k: v.clone() for k, v in trainer.state_dict().items() if torch.is_tensor(v)}
    return dict(trainer=trainer, weights=weights, steps=steps)


def _serve(base, weights, trace_path=None, max_new_tokens=96, **kw):
    from megatron_tsync.rollout.openai_server import ChatServer

    base["engine"].update_weights(weights, 0)
    base["engine"].calls.clear()
    sampling = SamplingConfig(temperature=TEMPERATURE, top_k=1, max_new_tokens=max_new_tokens,
                              stop_token_ids=(base["eos"],))
    return ChatServer(base["engine"], base["codec"], base["template"], sampling=sampling, model_name="tiny",
                      trace_path=trace_path, **kw)


@pytest.fixture()
def server(base):
    """A server on the untrained weights (greedy at T=0.7)."""
    with _serve(base, base["state"], max_new_tokens=16) as srv:
        yield srv


@pytest.fixture()
def taught_server(base, taught, tmp_path):
    """A server on the taught weights, writing a latency trace."""
    with _serve(base, taught["weights"], trace_path=str(tmp_path / "trace.jsonl")) as srv:
        yield srv


_CLIENTS = {}


def _client(server, episode):
    """An ``openai`` client of ``server`` naming ``episode`` in every request (one HTTP client per server)."""
    import openai

    if server.url not in _CLIENTS:
        _CLIENTS.clear()
        _CLIENTS[server.url] = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    return _CLIENTS[server.url].with_options(default_headers={"X-Episode-Id": episode})


def _http(server, method, path, body=None, headers=None):
    """One request with the test clients' credential (the ``openai`` clients' api_key, which an episode is bound to)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method, headers={
        "Content-Type": "application/json", "Authorization": "Bearer unused", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _harness(client, model="tiny@v0", max_turns=5):
    """A user's agent harness: the OpenAI chat loop with a local calculator tool."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    responses = []
    for _ in range(max_turns):
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        responses.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            expr = json.loads(call.function.arguments)["e"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expr))})  # noqa: S307
    return messages, responses


def _trainer_logprobs(model, ids):
    from megatron_tsync.model.logprobs import token_logprobs

    with torch.no_grad():
        return token_logprobs(model, torch.tensor([ids]), temperature=TEMPERATURE)[0].tolist()


def test_three_turn_tool_episode_is_token_exact(base, taught, taught_server, tmp_path):
    from megatron_tsync.rollout.agent_loop import Trajectory
    from megatron_tsync.rollout.openai_server import latency_profile_from_trace, main, trajectory_event
    from megatron_tsync.runtime.latency import load_latency_profile

    messages, responses = _harness(_client(taught_server, "ep-1"))
    assert len(responses) == 3, [r.choices[0].message for r in responses]
    for r, expr in zip(responses[:2], CALLS):
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "calc" and json.loads(call.function.arguments) == {"e": expr}
    assert responses[2].choices[0].message.content == FINAL and responses[2].choices[0].finish_reason == "stop"
    assert all(r.model == "tiny@v0" and r.tsync["policy_version"] == 0 for r in responses)

    status, traj = _http(taught_server, "POST", "/episodes/ep-1/finish",
                         {"verify_s": 0.25, "metadata": {"group": "g0"}})
    assert status == 200, traj
    ids, mask, lps, spans = traj["token_ids"], traj["loss_mask"], traj["logprobs"], traj["turn_spans"]
    calls = base["engine"].calls
    assert len(calls) == 3 and len(spans) == 3 and traj["policy_version"] == 0 and traj["turn_versions"] == [0] * 3
    for (prompt, comp), (s, e), r in zip(calls, spans, responses):
        assert ids[s:e] == comp.token_ids == r.tsync["completion_token_ids"]  # trained = sampled, exactly
        assert prompt == ids[:s]  # each turn continued the episode's exact tokens (nothing re-tokenised)
        assert lps[s:e] == [float(x) for x in comp.logprobs]
    on = [i for s, e in spans for i in range(s, e)]
    assert [i for i, v in enumerate(mask) if v] == on and traj["prompt_len"] == spans[0][0]
    assert [(c["name"], json.loads(c["args"])) for c in traj["tool_calls"]] == [("calc", [{"e": e}]) for e in CALLS]
    assert [tuple(c["result_span"]) for c in traj["tool_calls"]] == [(spans[0][1], spans[1][0]),
                                                                      (spans[1][1], spans[2][0])]
    # what the engine saw is the sequence the model was taught (the template continuation is the scripted one)
    assert (ids, mask) == _script_tokens(base["codec"], base["template"])

    ref = _trainer_logprobs(taught["trainer"], ids)
    diff = max(abs(ref[i - 1] - lps[i]) for i in on)
    perturbed = {k: v + 0.02 * torch.randn_like(v) for k, v in taught["weights"].items()}
    taught["trainer"].load_state_dict(perturbed, strict=False)
    try:
        other = _trainer_logprobs(taught["trainer"], ids)
        control = max(abs(other[i - 1] - lps[i]) for i in on)
    finally:
        taught["trainer"].load_state_dict(taught["weights"], strict=False)
    print(f"\nopenai episode: {len(ids)} tokens, {len(on)} trained, taught in {taught['steps']} steps; "
          f"log-prob max |engine - trainer| {diff:.2e} (perturbed-weights control {control:.2e})")
    assert diff <= ATOL and control > 1e-3

    # what the worker sends the learner: a valid transport event, bit-exact over the wire
    ev = trajectory_event(Trajectory(**{k: traj[k] for k in ("index", "token_ids", "prompt_len", "loss_mask",
                                                             "logprobs", "turn_spans", "policy_version", "metadata")}),
                          group_id="s0-g0", index=0, group_size=1, reward=1.0)
    ev.validate()
    assert type(ev).from_wire(ev.to_wire()) == ev and ev.token_ids.tolist() == ids and ev.policy_version == 0
    assert ev.logprobs[on].tolist() == pytest.approx([lps[i] for i in on], abs=1e-7)

    lines = [json.loads(x) for x in open(tmp_path / "trace.jsonl")]
    assert len(lines) == 1 and lines[0]["turns"] == 3 and len(lines[0]["tool_s"]) == 2 and lines[0]["verify_s"] == 0.25
    spec = latency_profile_from_trace(str(tmp_path / "trace.jsonl"))
    assert spec["groups"]["g0"][0] == lines[0]["tool_s"] + [0.25]
    assert latency_profile_from_trace(str(tmp_path / "trace.jsonl"), include_verify=False)["groups"]["g0"][0] == \
        lines[0]["tool_s"]
    assert main(["trace-to-profile", str(tmp_path / "trace.jsonl"), "--out", str(tmp_path / "p.json")]) == 0
    profile = load_latency_profile(str(tmp_path / "p.json"))  # what --latency-profile FILE.json loads
    assert [profile.sample(0, 0, t) for t in range(3)] == pytest.approx(lines[0]["tool_s"] + [0.25])
    assert main(["trace-to-profile", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "q.json")]) == 2
    assert _http(taught_server, "POST", "/episodes/ep-1/finish")[0] == 404  # finished once


def test_wrong_policy_version_refused(base, server):
    import openai

    msgs = [{"role": "user", "content": QUESTION}]
    with pytest.raises(openai.ConflictError, match="v3 requested"):
        _client(server, "ep-v").chat.completions.create(model="tiny@v3", messages=msgs)
    st, out = _http(server, "POST", "/chat/completions", {"model": "tiny", "messages": msgs},
                    {"X-Episode-Id": "ep-v", "X-Policy-Version": "2"})
    assert st == 409 and "v2 requested" in out["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="not served"):
        _client(server, "ep-v").chat.completions.create(model="other", messages=msgs)
    assert "ep-v" not in server.episodes  # refused first requests leave no episode

    client = _client(server, "ep-mid")
    r1 = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": SYSTEM},
                                                                   {"role": "user", "content": QUESTION}], tools=TOOLS)
    assert r1.tsync["policy_version"] == 0
    base["engine"].update_weights(base["state"], 1)  # the learner published new weights mid-episode
    follow = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
              r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    n_calls = len(base["engine"].calls)
    with pytest.raises(openai.ConflictError, match="changed mid-episode"):
        client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS)
    assert len(base["engine"].calls) == n_calls  # refused before sampling
    traj = server.finish("ep-mid")  # the trajectory so far is whole and single-version
    assert traj.turn_versions == [0] and traj.policy_version == 0
    r2 = _client(server, "ep-new").chat.completions.create(model="tiny@v1", messages=follow[:2], tools=TOOLS)
    assert r2.model == "tiny@v1" and server.finish("ep-new").policy_version == 1
    st, models = _http(server, "GET", "/models")
    assert st == 200 and [m["id"] for m in models["data"]] == ["tiny", "tiny@v1"]


def test_conversation_must_extend_the_episode(base, taught_server):
    server = taught_server
    client = _client(server, "ep-x")
    messages, responses = _harness(client, max_turns=1)
    assert responses[0].choices[0].message.tool_calls
    edited = json.loads(json.dumps(messages))
    edited[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"e": "1+1"})
    base = {"model": "tiny", "tools": TOOLS}
    hdr = {"X-Episode-Id": "ep-x"}
    cases = [
        ({**base, "messages": edited}, "messages[2] (assistant) differs"),
        ({**base, "messages": messages[:2]}, "already has 3"),
        ({**base, "messages": messages + [{"role": "assistant", "content": "forged"},
                                          {"role": "user", "content": "?"}]},
         "did not generate"),
        ({"model": "tiny", "messages": messages}, "'tools' differ"),
    ]
    for body, needle in cases:
        st, out = _http(server, "POST", "/chat/completions", body, hdr)
        assert st == 409 and needle in out["error"]["message"], (needle, st, out)
    # the episode is unchanged by the refusals: the real continuation still works
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"e": "33*2"}


def test_malformed_requests_get_400(base, server):
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    hdr = {"X-Episode-Id": "ep-bad"}
    cases = [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        ({"model": "tiny"}, "'messages' must be a non-empty list"),
        ({**ok, "model": 7}, "'model' must be a non-empty string"),
        ({**ok, "messages": ["hi"]}, "messages[0] must be an object"),
        ({**ok, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role must be one of"),
        ({**ok, "messages": [{"role": "user"}]}, "messages[0].content is required"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        ({**ok, "messages": [{"role": "tool", "content": "33"}]}, "needs a 'tool_call_id'"),
        ({**ok, "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": "{oops"}}]}]},
         "messages[0].tool_calls[0].function.arguments is not valid JSON"),
        ({**ok, "tools": [{"type": "function"}]}, "tools[0] must be"),
        ({**ok, "temperature": 1.3}, "samples with temperature=0.7"),
        ({**ok, "temperature": "hot"}, "'temperature' must be a number"),
        ({**ok, "max_tokens": 0}, "'max_tokens' must be an integer >= 1"),
        ({**ok, "n": 2}, "only n=1"),
        ({**ok, "stream": True}, "streaming responses are not supported"),
        ({**ok, "logit_bias": {"5": 10}}, "'logit_bias' is not supported"),
        ({**ok, "tool_choice": "required"}, "tool_choice must be"),
        ({**ok, "stop": [3]}, "'stop' must be"),
        ({**ok, "seed": "x"}, "'seed' must be an integer"),
        ({**ok, "messages": [{"role": "assistant", "content": "x"}]}, "nothing for the model to answer"),
    ]
    for body, needle in cases:
        st, out = _http(server, "POST", "/chat/completions", body, hdr)
        assert st == 400 and needle in out["error"]["message"], (needle, st, out)
    st, out = _http(server, "POST", "/chat/completions", ok)  # no episode id
    assert st == 400 and "X-Episode-Id" in out["error"]["message"]
    st, out = _http(server, "POST", "/chat/completions", {**ok, "messages": [{"role": "user", "content": "x" * 20000}]},
                    hdr)
    assert st == 400 and "context full" in out["error"]["message"]
    assert _http(server, "GET", "/nowhere")[0] == 404
    assert _http(server, "POST", "/episodes/unknown/finish")[0] == 404
    assert _http(server, "POST", "/episodes/unknown/finish", b"[]")[0] == 400
    assert not base["engine"].calls and not server.episodes  # nothing was sampled, nothing was left behind
    st, out = _http(server, "POST", "/chat/completions", {**ok, "user": "ep-ok", "max_tokens": 5, "logprobs": True})
    assert st == 200 and out["usage"]["completion_tokens"] <= 5  # and the server still serves
    assert [c["logprob"] for c in out["choices"][0]["logprobs"]["content"]] == base["engine"].calls[0][1].logprobs


def _set(body, path, value):
    """``body`` with the field at ``path`` (keys and list indices) replaced by ``value``."""
    out = json.loads(json.dumps(body))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def test_every_malformed_body_gets_4xx(base, server):
    """Bodies that are not a JSON object of text, and every field of a valid request replaced by every kind of wrong
    value: an OpenAI-style 4xx (or 200 where the value happens to be valid), never a 500, nothing left behind."""
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 2}
    raw = [
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "lone UTF-16 surrogate"),
        (b'{"model": "tiny", "messages": [{"role": "\\udfff", "content": "x"}]}', "lone UTF-16 surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, "deeper than 64"),
        (json.dumps(_set(ok, ["metadata"], json.loads("[" * 70 + "]" * 70))).encode(), "deeper than 64"),
        (json.dumps(ok)[:-1].encode() + b', "top_p": NaN}', "NaN is not a JSON number"),
        (b'"a string"', "must be a JSON object"), (b"null", "must be a JSON object"), (b"3", "must be a JSON object"),
        (b"\xff\xfe\x00", "not valid JSON"), (b"", "not valid JSON"), (b'{"a": 1} {"b": 2}', "not valid JSON"),
    ]
    for body, needle in raw:
        st, out = _http(server, "POST", "/chat/completions", body, {"X-Episode-Id": "ep-raw"})
        assert st == 400 and needle in out["error"]["message"], (body[:80], st, out)
    values = [None, 0, -1, 2 ** 70, 1.5, "", "x", [], {}, True, [[["deep"]]], {"k": "v"}, "\ud800"]
    paths = [["model"], ["messages"], ["messages", 0], ["messages", 0, "role"], ["messages", 0, "content"],
             ["messages", 0, "tool_calls"], ["messages", 0, "name"], ["tools"], ["tools", 0], ["tools", 0, "type"],
             ["tools", 0, "function"], ["tools", 0, "function", "parameters"], ["temperature"], ["top_p"],
             ["max_tokens"], ["n"], ["stream"], ["seed"], ["stop"], ["logprobs"], ["tool_choice"],
             ["response_format"], ["top_logprobs"], ["logit_bias"], ["user"]]
    statuses = {}
    for p in paths:
        for k, v in enumerate(values):
            ep = f"fz-{'.'.join(map(str, p))}-{k}"
            st, out = _http(server, "POST", "/chat/completions", _set(ok, p, v), {"X-Episode-Id": ep})
            statuses[st] = statuses.get(st, 0) + 1
            assert st == 200 or (400 <= st < 500 and out["error"]["message"] and out["error"]["type"]), (p, v, st, out)
            if st == 200:
                assert server.finish(ep).turn_spans
            assert ep not in server.episodes
    for verify_s, meta in [("1", {}), (True, {}), (1.0, []), (1.0, "x"), (None, {"deep": [[[[[]]]]]})]:
        st, out = _http(server, "POST", "/episodes/none/finish", {"verify_s": verify_s, "metadata": meta})
        assert st in (400, 404), (verify_s, meta, st, out)
    print(f"\n{len(paths) * len(values)} field mutations: statuses {sorted(statuses.items())}")
    assert 500 not in statuses and statuses.get(200) and statuses.get(400)


def test_api_key_and_episode_ownership(base, capsys):
    """With an API key every request needs it (401); an episode is served only to the credential that opened it
    (403 for anyone else): its X-Episode-Secret, else its bearer token, else a secret the server generated and
    returned. A non-loopback bind without a key is refused (the class raises, the CLI prints one line, exit 2)."""
    import openai

    from megatron_tsync.rollout.openai_server import main

    msgs = [{"role": "user", "content": "hi"}]
    with _serve(base, base["state"], max_new_tokens=4, api_key="k1") as srv:
        st, out = _http(srv, "GET", "/models")  # the helper's "Bearer unused" is not the key
        assert st == 401 and out["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0).models.list()
        key = openai.OpenAI(base_url=srv.url, api_key="k1", max_retries=0, timeout=60)
        alice = key.with_options(default_headers={"X-Episode-Id": "shared", "X-Episode-Secret": "alice"})
        bob = key.with_options(default_headers={"X-Episode-Id": "shared", "X-Episode-Secret": "bob"})
        r = alice.chat.completions.create(model="tiny", messages=msgs)
        follow = msgs + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        with pytest.raises(openai.PermissionDeniedError, match="opened by another client"):
            bob.chat.completions.create(model="tiny", messages=follow)
        bob_hdr = {"Authorization": "Bearer k1", "X-Episode-Secret": "bob"}
        assert _http(srv, "POST", "/episodes/shared/finish", {}, bob_hdr)[0] == 403
        assert _http(srv, "DELETE", "/episodes/shared", None, bob_hdr)[0] == 403
        alice.chat.completions.create(model="tiny", messages=follow)  # the owner goes on
        st, traj = _http(srv, "POST", "/episodes/shared/finish", {}, {**bob_hdr, "X-Episode-Secret": "alice"})
        assert st == 200 and len(traj["turn_spans"]) == 2

    with _serve(base, base["state"], max_new_tokens=4) as srv:
        req = urllib.request.Request(srv.url + "/chat/completions", method="POST", data=json.dumps(
            {"model": "tiny", "messages": msgs}).encode(), headers={"X-Episode-Id": "anon"})  # no credential at all
        with urllib.request.urlopen(req, timeout=60) as resp:
            secret, out = resp.headers["X-Episode-Secret"], json.loads(resp.read())
        assert secret and out["tsync"]["episode_secret"] == secret
        assert _http(srv, "POST", "/episodes/anon/finish", {}, {"Authorization": ""})[0] == 403
        assert _http(srv, "POST", "/episodes/anon/finish")[0] == 403  # another client's bearer token
        assert _http(srv, "POST", "/episodes/anon/finish", {}, {"X-Episode-Secret": secret})[0] == 200
        a = openai.OpenAI(base_url=srv.url, api_key="a", max_retries=0, timeout=60)  # bound to its api_key
        a.with_options(default_headers={"X-Episode-Id": "by-a"}).chat.completions.create(model="tiny", messages=msgs)
        assert _http(srv, "DELETE", "/episodes/by-a", None, {"Authorization": "Bearer b"})[0] == 403
        assert _http(srv, "DELETE", "/episodes/by-a", None, {"Authorization": "Bearer a"})[0] == 200
        body = json.dumps({"model": "tiny", "messages": msgs}).encode()  # in-process callers are trusted
        st, out = srv.handle("POST", "/v1/chat/completions", {"X-Episode-Id": "inproc"}, body)
        follow = msgs + [out["choices"][0]["message"], {"role": "user", "content": "more"}]
        again = json.dumps({"model": "tiny", "messages": follow}).encode()
        assert srv.handle("POST", "/v1/chat/completions", {"X-Episode-Id": "inproc"}, again, trusted=False)[0] == 403
        assert srv.handle("POST", "/v1/chat/completions", {"X-Episode-Id": "inproc"}, again)[0] == 200

    with pytest.raises(ValueError, match="refusing to serve on '0.0.0.0' without an API key"):
        _serve(base, base["state"], host="0.0.0.0")
    capsys.readouterr()
    assert main(["serve", "--model", "/nonexistent", "--host", "0.0.0.0", "--api-key", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: refusing to serve on '0.0.0.0' without an API key")


def test_fixed_sampling_flag(base):
    """``fixed_sampling=False`` lets a request choose its temperature and a larger cap; the trajectory records the
    temperature of each turn (with the default, the same request is refused: test_malformed_requests_get_400)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.3, "max_tokens": 40}
    for fixed in (True, False):
        with _serve(base, base["state"], max_new_tokens=16, fixed_sampling=fixed) as srv:
            st, out = _http(srv, "POST", "/chat/completions", body, {"X-Episode-Id": "t"})
            if fixed:
                assert st == 400 and "temperature=0.7" in out["error"]["message"]
                continue
            assert st == 200 and base["engine"].sampling.temperature == 1.3
            assert base["engine"].sampling.max_new_tokens == 40
            assert srv.finish("t").metadata["temperatures"] == [1.3]


def test_concurrent_episodes_are_batched_exactly(base):
    """Four harnesses at once: their requests share engine calls, and every episode gets exactly the tokens it gets
    alone (per-episode seeds, per-request caps)."""
    from concurrent.futures import ThreadPoolExecutor

    from megatron_tsync.rollout.openai_server import ChatServer

    engine = base["engine"]
    engine.update_weights(base["state"], 0)
    sampling = SamplingConfig(max_new_tokens=12, stop_token_ids=(base["eos"],), seed=5)

    def episode(srv, k):
        c = _client(srv, f"cc-{k}")
        msgs = [{"role": "user", "content": f"task {k}"}]
        r = c.chat.completions.create(model="raw", messages=msgs, max_tokens=6 + 2 * k)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "next"}]
        c.chat.completions.create(model="raw", messages=msgs)
        return srv.finish(f"cc-{k}").token_ids

    results = {}
    for wait in (0.0, 0.5):
        engine.batch_sizes = []
        with ChatServer(engine, base["codec"], base["template"], sampling=sampling, model_name="raw",
                        batch_wait_s=wait) as srv:
            if wait == 0.0:
                results[wait] = [episode(srv, k) for k in range(4)]  # one at a time
            else:
                with ThreadPoolExecutor(4) as pool:
                    results[wait] = list(pool.map(lambda k: episode(srv, k), range(4)))
        sizes = list(engine.batch_sizes)
    assert max(sizes) > 1 and len(sizes) < 8, sizes  # batched: fewer engine calls than the 8 requests
    assert results[0.5] == results[0.0]
    assert len({tuple(t) for t in results[0.0]}) == 4


def test_batcher_serves_the_others_when_one_request_is_bad(base):
    from concurrent.futures import ThreadPoolExecutor

    from megatron_tsync.rollout.chat_batcher import EngineBatcher

    engine = base["engine"]
    engine.update_weights(base["state"], 0)
    cfg = SamplingConfig(max_new_tokens=8, seed=1)
    jobs = [([5, 6, 7], 11), ([9] * 4094, 12), ([8, 9], 13)]  # the middle one exceeds the model's 4096 positions
    alone = [engine.generate([p], cfg, 1, seeds=[sd])[0][0].token_ids for p, sd in (jobs[0], jobs[2])]
    batcher = EngineBatcher(engine, 0.5)
    try:
        def submit(job):
            try:
                return batcher.generate(job[0], cfg, job[1]).token_ids
            except ValueError as e:
                return str(e)

        with ThreadPoolExecutor(3) as pool:
            out = list(pool.map(submit, jobs))
    finally:
        batcher.close()
    assert out[0] == alone[0] and out[2] == alone[1] and "max_position_embeddings" in out[1]
    assert batcher.batches[0] == 3 and batcher.batches[1:] == [1, 1, 1], batcher.batches


def test_generated_tokens_are_not_retokenised(base):
    """An untrained policy sampled at T=1 emits token sequences that decode -> encode changes (control); the server
    still continues each episode from the exact sampled ids."""
    from megatron_tsync.rollout.openai_server import ChatServer

    engine, codec = base["engine"], base["codec"]
    engine.update_weights(base["state"], 0)
    engine.calls.clear()
    sampling = SamplingConfig(max_new_tokens=24, stop_token_ids=(base["eos"],), seed=11)
    changed = 0
    with ChatServer(engine, codec, base["template"], sampling=sampling, model_name="raw") as srv:
        for k in range(4):
            msgs = [{"role": "user", "content": f"question {k}"}]
            c = _client(srv, f"raw-{k}")
            r = c.chat.completions.create(model="raw", messages=msgs)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            c.chat.completions.create(model="raw", messages=msgs)
            (p1, c1), (p2, _) = engine.calls[-2:]
            assert p2[: len(p1) + len(c1.token_ids)] == p1 + c1.token_ids
            changed += codec.encode(codec.decode(c1.token_ids)) != c1.token_ids
            traj = srv.finish(f"raw-{k}")
            assert traj.token_ids[traj.turn_spans[0][0]:traj.turn_spans[0][1]] == c1.token_ids
            assert traj.token_ids[: len(p2)] == p2 and traj.turn_spans[1][0] == len(p2)
    assert changed > 0, "control: re-tokenising the sampled text never changed it, the test could not fail"


@pytest.mark.slow
def test_command_line_serve(tiny_dir, tmp_path):
    """``python -m megatron_tsync.rollout.openai_server serve``: each flag visibly in effect, the trace written, a clean
    exit on SIGTERM (~30 s on 2 busy cores: a fresh interpreter loads megatron and the model)."""
    import os
    import socket
    import subprocess
    import sys
    import threading
    import types

    trace = tmp_path / "trace.jsonl"
    cmd = [sys.executable, "-m", "megatron_tsync.rollout.openai_server", "serve", "--model", tiny_dir, "--port", "0",
           "--host", "0.0.0.0", "--max-connections", "4", "--max-connections-per-peer", "1", "--write-timeout", "0.5",
           "--max-episodes", "2", "--episode-idle-timeout", "5",
           "--model-name", "cli", "--temperature", "0.5", "--top-k", "1", "--max-new-tokens", "8",
           "--max-context-tokens", "200", "--trace", str(trace)]
    # the key the test helpers send: a non-loopback bind is served with it (and refused without one, see
    # test_api_key_and_episode_ownership)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TSYNC_API_KEY": "unused"}
    env.pop("MASTER_PORT", None)
    err = open(tmp_path / "serve.err", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://"), line
        srv = types.SimpleNamespace(url=line.split()[1])
        assert [m["id"] for m in _http(srv, "GET", "/models")[1]["data"]] == ["cli", "cli@v0"]
        assert _http(srv, "GET", "/models", None, {"Authorization": "Bearer other"})[0] == 401
        address = ("127.0.0.1", int(srv.url.split(":")[2].split("/")[0]))
        with socket.create_connection(address):  # held open: this address' one connection (per peer)
            st, out = _http(srv, "GET", "/models")
            assert st == 429 and "max_connections_per_peer" in out["error"]["message"]
            with socket.create_connection(address, source_address=("127.0.0.2", 0)) as other:  # another address
                other.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer unused\r\n"
                              b"Connection: close\r\n\r\n")
                assert other.recv(4096).startswith(b"HTTP/1.1 200 ")
        reader = socket.socket()  # --write-timeout: a client that pipelines and never reads is disconnected
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.bind(("127.0.0.3", 0))
        reader.connect(address)
        threading.Thread(target=_send_quietly, args=(reader, (b"GET /" + b"x" * 4000 + b" HTTP/1.1\r\nHost: t\r\n"
                                                              b"Authorization: Bearer unused\r\n\r\n") * 2000),
                         daemon=True).start()
        assert _until(lambda: _http(srv, "GET", "/tsync/stats")[1]["http"]["write_timeouts"] == 1, 60)
        reader.close()
        body = {"model": "cli", "messages": [{"role": "user", "content": "2+2?"}]}
        st, out = _http(srv, "POST", "/chat/completions", {**body, "temperature": 0.7}, {"X-Episode-Id": "a"})
        assert st == 400 and "temperature=0.5" in out["error"]["message"]
        outs = [_http(srv, "POST", "/chat/completions", body, {"X-Episode-Id": ep})[1] for ep in ("a", "b")]
        assert all(o["usage"]["completion_tokens"] <= 8 for o in outs)
        ids = [o["tsync"]["completion_token_ids"] for o in outs]
        assert ids[0] == ids[1]  # --top-k 1: greedy, the same in every episode
        long = {**body, "messages": [{"role": "user", "content": "9" * 300}]}
        st, out = _http(srv, "POST", "/chat/completions", long, {"X-Episode-Id": "c"})
        assert st == 400 and "max_context_tokens 200" in out["error"]["message"]
        assert _http(srv, "POST", "/episodes/a/finish", {"verify_s": 1.5})[0] == 200
        for ep in ("d", "e"):  # --max-episodes 2: b, d, e opened, b evicted
            assert _http(srv, "POST", "/chat/completions", body, {"X-Episode-Id": ep})[0] == 200
        stats = _http(srv, "GET", "/tsync/stats")[1]
        assert stats["episodes"] == 2 and stats["episodes_evicted"] == 1 and stats["max_episodes"] == 2
        st, out = _http(srv, "POST", "/episodes/b/finish")
        assert st == 410 and out["error"]["code"] == "episode_evicted"
        assert _until(lambda: _http(srv, "GET", "/tsync/stats")[1]["episodes_expired"] == 2, 60)  # idle 5 s
        proc.terminate()
        assert proc.wait(timeout=30) == 0, (tmp_path / "serve.err").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        err.close()
    (rec,) = [json.loads(x) for x in open(trace)]
    assert rec["turns"] == 1 and rec["verify_s"] == 1.5


def _send_quietly(sock, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the server aborted the connection (or the test closed it)
        pass


def _until(cond, timeout_s: float) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_serve_limit_flags_reach_the_server():
    """The ``serve`` limit flags become the server's limits (their effects: test_command_line_serve and
    tests/rollout/test_http_server.py); 0 turns a cap off; the defaults are the library's."""
    from megatron_tsync.rollout.openai_server import _parser, _server_limits

    def kw(*flags):
        return _server_limits(_parser().parse_args(["serve", "--model", "m", "--max-connections", "64", *flags]))

    d = kw()
    assert d["limits"].peer_cap == 32 and d["limits"].write_timeout_s == 30.0 and d["limits"].max_connections == 64
    assert (d["max_episodes"], d["episode_idle_s"]) == (1024, 600.0)
    d = kw("--max-connections-per-peer", "3", "--write-timeout", "0.25", "--max-episodes", "7",
           "--episode-idle-timeout", "9")
    assert d["limits"].peer_cap == 3 and d["limits"].write_timeout_s == 0.25
    assert (d["max_episodes"], d["episode_idle_s"]) == (7, 9)
    d = kw("--max-episodes", "0", "--episode-idle-timeout", "0", "--max-connections-per-peer", "0")
    assert d["max_episodes"] is None and d["episode_idle_s"] is None and d["limits"].peer_cap == 64
