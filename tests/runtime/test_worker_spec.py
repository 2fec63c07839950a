"""WorkerSpec: the typed config sections a rollout worker is started with, and what the worker derives from them."""

import dataclasses
import json
import shutil
import tempfile

import pytest

from megatron_tsync.arguments import parse_args
from megatron_tsync.config import RLConfig, RolloutConfig
from megatron_tsync.rollout.engine import RUNTIME_FIELDS, SamplingConfig
from megatron_tsync.runtime import worker as W
from megatron_tsync.runtime.worker import WorkerSpec


def _spec(**changes) -> WorkerSpec:
    base = WorkerSpec(rl=RLConfig(group_size=3, max_new_tokens=16, seq_length=128),
                      rollout=RolloutConfig(temperature=0.7, top_k=5, top_p=0.9), engine_dtype="float32",
                      stream_turns=False, model_dir="m", start_step=2, worker_id=1, endpoint="ipc:///tmp/x.sock",
                      secret_file="s.hex", run_id="0123456789abcdef", weights_dir="w", weight_sync_addr="", weight_sync_backend="gloo",
                      record_routing=False, reward_spec={"kind": "bounded", "lo": 0.0, "hi": 1.0})
    return dataclasses.replace(base, **changes)


def test_json_round_trip_and_refusals(tmp_path) -> None:
    spec = _spec(rl=RLConfig(max_staleness=2, seed=7), stream_turns=True)
    path = str(tmp_path / "worker1.json")
    spec.to_json(path)
    assert WorkerSpec.from_json(path) == spec
    data = json.loads(open(path).read())
    assert data["rl"]["max_staleness"] == 2 and data["rollout"]["top_p"] == 0.9  # sections as nested dicts
    for bad, match in (({**data, "format": None}, "not a tsync-worker-spec-v1"),
                       ({k: v for k, v in data.items() if k != "endpoint"}, r"missing \['endpoint'\]"),
                       ({**data, "temperature": 1.0}, r"unknown \['temperature'\]")):
        with open(path, "w") as f:
            json.dump(bad, f)
        with pytest.raises(ValueError, match=match):
            WorkerSpec.from_json(path)


def test_no_field_has_a_default() -> None:
    """Defaults drifted from the config before (max_turns 3 vs 4, max_new_tokens 32 vs 64): the fleet states every
    field, and the run's settings are the config's own sections."""
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(WorkerSpec))
    types = {f.name: f.type for f in dataclasses.fields(WorkerSpec)}
    assert types["rl"] == "RLConfig" and types["rollout"] == "RolloutConfig"


class _Tok:
    eos_token_id = 1
    _ids = {"</answer>": 8, "</tool>": 4}

    def convert_tokens_to_ids(self, t):
        return self._ids[t]


def test_sampling_is_derived_from_the_config_once() -> None:
    spec = _spec()
    s = W.sampling_config(spec.rollout, spec.rl, _Tok())
    assert (s.temperature, s.top_k, s.top_p, s.max_new_tokens) == (0.7, 5, 0.9, 16)
    assert (s.stop_token_ids, s.tool_token_ids, s.seed) == ((1, 8), (4,), None)


def test_every_sampling_field_has_a_config_field_of_its_name() -> None:
    s = SamplingConfig.from_config(RolloutConfig(), RLConfig())
    derived = [f.name for f in dataclasses.fields(SamplingConfig) if f.name not in RUNTIME_FIELDS]
    assert derived == ["temperature", "top_k", "top_p", "max_new_tokens"]
    assert s == SamplingConfig(max_new_tokens=RLConfig().max_new_tokens)

    @dataclasses.dataclass(frozen=True)
    class WithMinP(SamplingConfig):  # a new sampling parameter without its config field is caught at once
        min_p: float = 0.0

    with pytest.raises(TypeError, match="WithMinP|min_p"):
        WithMinP.from_config(RolloutConfig(), RLConfig())
    with pytest.raises(TypeError, match="not run-time fields"):
        SamplingConfig.from_config(RolloutConfig(), RLConfig(), temperature=0.5)


@pytest.fixture
def short_dir():
    d = tempfile.mkdtemp(prefix="tsync-spec-", dir="/tmp")  # ipc:// paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_factory_receives_the_tensor_parallel_flag(tp, short_dir, monkeypatch) -> None:
    """--rollout-tensor-parallel-size → TrainConfig → worker spec file → the vLLM engine's constructor."""
    from megatron_tsync.rollout.vllm_engine import VLLMEngine
    from megatron_tsync.runtime.fleet import open_fleet

    cfg = parse_args(["--rollout-engine", "vllm", "--rollout-tensor-parallel-size", str(tp), "--seq-length", "96",
                      "--seed", "5", "--rollout-launch", "external", "--rollout-dir", short_dir])
    fleet = open_fleet(cfg, model_dir="/models/m", start_step=0, reward_floor=0.0)
    fleet.close()
    spec = WorkerSpec.from_json(f"{short_dir}/worker0.json")
    got = {}
    monkeypatch.setattr(VLLMEngine, "from_hf_dir", classmethod(lambda cls, d, **kw: got.update(kw, model_dir=d)))
    W._make_engine(spec)
    want = dict(model_dir="/models/m", seed=5, dtype="float32", max_model_len=96, record_routing=False)
    if tp > 1:
        want.update(tensor_parallel_size=tp, in_process=False)
    assert got == want
