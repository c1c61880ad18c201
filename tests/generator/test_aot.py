"""colo_rl/generator/aot.py: torch's AOT pickler saves a compiled function whose code calls a
functools.wraps-decorated method (as Transformers' model forwards are, which vLLM's Transformers
backend compiles), and a fresh process without colo_rl's patch loads it and computes the same."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODEL = textwrap.dedent("""
    import functools
    import torch

    def doubled(f):
        @functools.wraps(f)
        def wrapper(self, x, *, k=2):
            return f(self, x) * k
        return wrapper

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        @doubled
        def forward(self, x):
            return self.lin(x) + 1
""")

SAVE = textwrap.dedent("""
    import sys
    import torch
    if sys.argv[2] == "patched":
        from colo_rl.generator import aot
        assert aot.install()
    import wrapped_model
    torch.manual_seed(0)
    m = wrapped_model.M()
    fn = torch.compile(m.forward, fullgraph=True).aot_compile(((torch.ones(2, 4),), {}))
    torch.save(m.state_dict(), sys.argv[1] + "/m.pt")
    try:
        fn.save_compiled_function(sys.argv[1] + "/fn.bin")
    except Exception as exc:
        print("NOT SAVED", type(exc).__name__, exc)
    else:
        print("SAVED")
""")

LOAD = textwrap.dedent("""
    import sys
    import torch
    import wrapped_model
    m = wrapped_model.M()
    m.load_state_dict(torch.load(sys.argv[1] + "/m.pt"))
    x = torch.arange(8.0).reshape(2, 4)
    with open(sys.argv[1] + "/fn.bin", "rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    print("LOADED", torch.equal(loaded(m, x), m(x)), "colo_rl.generator.aot" in sys.modules)
""")


def run(code: str, work: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code, str(work), *args], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_compiled_wrapped_forward_saves_and_loads_in_a_fresh_process(tmp_path):
    (tmp_path / "wrapped_model.py").write_text(MODEL)
    plain = run(SAVE, tmp_path, "plain")
    if "SAVED" in plain.splitlines():
        pytest.skip("this torch's AOT pickler saves wrapped functions itself (pytorch/pytorch#196454)")
    assert "it's not the same object as wrapped_model.M.forward" in plain
    assert "SAVED" in run(SAVE, tmp_path, "patched").splitlines()
    # the rebuilt functions refer to colo_rl's rebuild_function, which the load imports
    assert "LOADED True True" in run(LOAD, tmp_path)
