"""Package boundaries: no megatron / training / rollout imports, no pickle anywhere on the wire."""

import pathlib
import re
import subprocess
import sys

import megatron_tsync.transport as transport

SRC = pathlib.Path(transport.__file__).parent


def test_imports_stay_inside_the_boundary() -> None:
    code = ("import sys, megatron_tsync.transport as t; t.publish_weights; "
            "bad = [m for m in sys.modules if m == 'megatron' or m.startswith(('megatron.', "
            "'megatron_tsync.training', 'megatron_tsync.rollout', 'megatron_tsync.streaming'))]; "
            "print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_pickle_and_files_stay_small() -> None:
    for f in SRC.glob("*.py"):
        text = f.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, f
        assert not re.search(r"(?<!safetensors\.)torch\.load\(", text), f  # torch.load unpickles
        assert len(text.splitlines()) <= 800, f
