"""agent.entrypoint: `path/to/agent.py:run` (a file) or `package.module:run` (an importable module)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path

from rlfabric.core.config import ConfigError


def split_entrypoint(entrypoint: str) -> tuple[str, str]:
    """(file or module, function name); ConfigError naming agent.entrypoint when it is not `X:function`."""
    where, _, name = entrypoint.rpartition(":")
    if not where or not name.isidentifier():
        raise ConfigError(f"agent.entrypoint {entrypoint!r}: write path/to/agent.py:run or package.module:run")
    return where, name


def check_entrypoint(entrypoint: str) -> None:
    """That the file or module exists, without importing it (the subprocess runner imports it per episode)."""
    where, _ = split_entrypoint(entrypoint)
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise ConfigError(f"agent.entrypoint {entrypoint!r}: no file {Path(where).resolve()}")
    elif _find_spec(where) is None:
        raise ConfigError(f"agent.entrypoint {entrypoint!r}: no module {where!r} on the path")


def _find_spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:  # its package is missing
        return None


def load_entrypoint(entrypoint: str) -> Callable:
    """The agent's `async def run(task, llm)`; ConfigError naming agent.entrypoint when it cannot be loaded."""
    where, name = split_entrypoint(entrypoint)
    check_entrypoint(entrypoint)
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            # A name of its own per file: two agents called agent.py do not replace each other in sys.modules.
            module_name = f"rlfabric_agent_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as error:
        raise ConfigError(f"agent.entrypoint {entrypoint!r}: importing {where} failed: "
                          f"{type(error).__name__}: {error}") from error
    function = getattr(module, name, None)
    if not inspect.iscoroutinefunction(function):
        raise ConfigError(f"agent.entrypoint {entrypoint!r}: {where} has no `async def {name}(task, llm)`")
    return function
