"""A virtual environment holding VeRL itself, for tests that compare rlfabric's algorithm math with VeRL's own
functions (tests/algorithms/test_verl_parity.py).

VeRL is installed with --no-deps, plus only the small packages that importing verl.trainer.ppo.core_algos needs
and rlfabric's environment lacks; torch, numpy and the rest come from this interpreter's site-packages through a
.pth line, so torch is not installed twice. Built once per machine and VeRL version, under
~/.cache/rlfabric/verl-venv/, by tests/side_venv.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.side_venv import SideVenv

VERL_VERSION = "0.9.1"
# What `import verl.trainer.ppo.core_algos` needs beyond rlfabric's dependencies and dev tools (found by importing
# it in a venv of verl alone): verl/__init__ imports its DataProto (tensordict, which needs pyvers), the configs
# import omegaconf (whose parser needs antlr4), the profiler imports codetiming and orjson. Pinned to what
# verl 0.9.1 (tensordict<=0.10, hydra-core's omegaconf 2.3) and tensordict 0.10 (pyvers<0.2) ask for.
SMALL_DEPS = (
    "tensordict==0.10.0",
    "pyvers>=0.1,<0.2",
    "omegaconf==2.3.0",
    "antlr4-python3-runtime==4.9.3",
    "codetiming>=1.4",
    "orjson>=3.9",
)
VERL = SideVenv("verl", VERL_VERSION, (f"verl=={VERL_VERSION}", *SMALL_DEPS), "import verl.trainer.ppo.core_algos",
                host_modules=("torch", "numpy"))


def verl_python() -> Path:
    """The VeRL venv's interpreter, building the venv on first use (~20 s with a warm pip cache)."""
    return VERL.python()
