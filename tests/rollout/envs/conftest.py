"""Shared fixtures of the environment tests: one sandbox, one verifier, one swe-lite environment per module."""

import pytest

from megatron_tsync.rollout.envs.swe_lite import SweLiteEnv
from megatron_tsync.rollout.envs.terminal_lite import TerminalLiteEnv
from megatron_tsync.rollout.envs.verifier import HiddenTestVerifier
from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig


@pytest.fixture(scope="session")
def env_sandbox():
    return Sandbox(SandboxConfig(wall_timeout_s=60.0, cpu_seconds=60))  # generous: no test here is about the limit, and CI runs at load 3+


@pytest.fixture(scope="session")
def hidden_verifier():
    return HiddenTestVerifier(config=SandboxConfig(wall_timeout_s=30.0, cpu_seconds=30, memory_bytes=2 << 30,
                                                   max_output_bytes=4 << 20))


@pytest.fixture(scope="session")
def swe_env(env_sandbox, hidden_verifier):
    return SweLiteEnv(sandbox=env_sandbox, verifier=hidden_verifier)


@pytest.fixture(scope="session")
def terminal_env(env_sandbox, hidden_verifier):
    return TerminalLiteEnv(sandbox=env_sandbox, verifier=hidden_verifier)
