"""The python tool's sandbox as root: nothing kept between calls (a private /tmp, or the call's files deleted),
the memory limit over all the call's processes together, and no uid shared with the reward scorer, so the
model's code can neither signal it nor use up its RLIMIT_NPROC."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlfabric.core.config import EnvConfig, RewardConfig
from rlfabric.env import PythonEnvironment
from rlfabric.env.items import STEP_OK, STEP_TOOL_ERROR, Action, Task, ToolCall
from rlfabric.env.python_tool import run_python
from rlfabric.reward import STATUS_OK, CustomScorerPool, ScoreItem
from rlfabric.sandbox.confine import SHARED_TEMP_DIRS, claim_uid
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the sandbox's uids and mounts need root"
)


def run_code(code: str, **python) -> tuple[str, str]:
    """(status, what the model reads) of one python call in a fresh environment."""
    environment = PythonEnvironment(Task("python", ground_truth="1"), EnvConfig(python=python))
    result = environment.step(Action("", (ToolCall("python", json.dumps({"code": code})),)))
    return result.status, result.observation[0].content


@pytest.fixture
def file_name():
    """A name no one else uses; whatever a failing run leaves under it in the host's temp dirs is removed."""
    name = f"rlfabric-test-kept-{secrets.token_hex(6)}"
    yield name
    for directory in SHARED_TEMP_DIRS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


@pytest.mark.parametrize("private_tmp", [True, False], ids=["private", "cleared"])
def test_no_files_are_kept_between_calls(private_tmp, file_name):
    directories = [*SHARED_TEMP_DIRS, "."]
    write = textwrap.dedent(f"""
        import os
        for directory in {directories!r}:
            with open(os.path.join(directory, {file_name!r}), "w") as file:
                file.write("state")
        print("written")
        """)
    status, output = run_code(write, sandbox={"private_tmp": private_tmp})
    assert (status, output) == (STEP_OK, "written\n")
    # Private: written to tmpfs of the call's own; cleared: to the host's, deleted after the call.
    assert not any(os.path.exists(os.path.join(d, file_name)) for d in SHARED_TEMP_DIRS)
    read = f"import os\nprint([d for d in {directories!r} if os.path.exists(os.path.join(d, {file_name!r}))])"
    assert run_code(read, sandbox={"private_tmp": private_tmp}) == (STEP_OK, "[]\n")


def test_a_private_tmp_shows_nothing_of_the_hosts():
    marker = Path(tempfile.mkdtemp(prefix="rlfabric-test-host-"))
    try:
        status, output = run_code("import json, os\nprint(json.dumps([os.listdir('/tmp'), os.getcwd()]))")
        assert status == STEP_OK
        listed, cwd = json.loads(output)
        assert listed == [os.path.basename(cwd)] and cwd.startswith("/tmp/")  # only its working directory
    finally:
        shutil.rmtree(marker)


HOGS = textwrap.dedent("""
    import os, time
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            hog = bytearray(160 * 2**20)
            for offset in range(0, len(hog), 4096):  # resident, not merely reserved
                hog[offset] = 1
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    print("all done")
    """)


@pytest.mark.parametrize("memory_cgroup", [True, False], ids=["cgroup", "counted"])
def test_the_memory_limit_holds_for_all_the_calls_processes_together(memory_cgroup):
    # Four children of 160 MiB each pass no one's RLIMIT_AS of 256 MiB, but 640 MiB together.
    python = {"memory_limit_mb": 256, "timeout_s": 30, "sandbox": {"memory_cgroup": memory_cgroup}}
    status, output = run_code(HOGS, **python)
    assert status == STEP_TOOL_ERROR and "went past its memory limit of 256 MiB" in output, output
    assert "all done" not in output
    assert run_code("print(6 * 7)", **python) == (STEP_OK, "42\n")  # the next call runs


SCORER = textwrap.dedent("""
    import os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        # Hold every process RLIMIT_NPROC allows, say so, and wait until the tool's code has run.
        read_end, write_end = os.pipe()
        children = []
        try:
            while True:
                pid = os.fork()
                if pid == 0:
                    os.close(write_end)
                    os.read(read_end, 1)
                    os._exit(0)
                children.append(pid)
        except OSError:
            pass
        with open(os.path.join(extra_info["dir"], "full"), "w") as full:
            full.write(str(len(children)))
        end = time.monotonic() + 60
        while not os.path.exists(os.path.join(extra_info["dir"], "go")) and time.monotonic() < end:
            time.sleep(0.01)
        os.close(write_end)
        for pid in children:
            os.waitpid(pid, 0)
        return float(len(children))
    """)
TOOL_CODE = textwrap.dedent("""
    import os, signal
    forked = 0
    for _ in range(8):
        try:
            if os.fork() == 0:
                os._exit(0)
        except OSError:
            break
        forked += 1
    print("forked", forked)
    os.kill(-1, signal.SIGKILL)  # every process its uid may signal
    print("survived")
    """)


@pytest.fixture
def shared_directory():
    """A directory the test and the reward item both see: in /run, since the sandbox's /tmp is its own."""
    directory = Path(tempfile.mkdtemp(prefix="rlfabric-test-shared-", dir="/run"))
    directory.chmod(0o1777)
    yield directory
    shutil.rmtree(directory)


def test_tool_code_cannot_signal_the_reward_scorer_nor_use_up_its_processes(shared_directory):
    """With both sandboxes' default uids: while a reward item holds every process its RLIMIT_NPROC allows,
    the model's code still forks (its own limit), and its kill(-1, SIGKILL) leaves the item running."""
    path = shared_directory / "reward.py"
    path.write_text(SCORER)
    reward_sandbox = RewardConfig(custom_sandbox={"max_processes": 32}).custom_sandbox
    python = EnvConfig(python={"sandbox": {"max_processes": 32}}).python
    with CustomScorerPool(str(path), num_workers=1, timeout_s=60, sandbox=reward_sandbox) as pool, \
            ThreadPoolExecutor(1) as scoring:
        item = ScoreItem("x", "r", "g", extra_info={"dir": str(shared_directory)})
        scored = scoring.submit(pool.score_batch, [item])
        wait_until(lambda: (shared_directory / "full").exists() or scored.done(), 60, "the reward item to fill up")
        output = run_python(TOOL_CODE, python)
        (shared_directory / "go").touch()
        (result,) = scored.result(timeout=60)
    assert output == "forked 8\nsurvived\n"
    assert result.status == STATUS_OK, result
    assert result.score == float((shared_directory / "full").read_text()) > 8


def test_a_call_waits_for_a_free_uid_and_says_when_none_came():
    first = 3_600_000 + os.getpid() % 100_000  # a range of one uid, no one else's
    sandbox = {"uid": first, "uid_count": 1}
    held = claim_uid(first, 1)  # as a concurrent call would
    try:
        status, output = run_code("print(1)", timeout_s=4, sandbox=sandbox)
        assert status == STEP_TOOL_ERROR and "did not run: no free uid for the sandbox" in output, output
        threading.Timer(0.5, held.release).start()  # the other call ends meanwhile
        assert run_code("import os\nprint(os.getuid())", timeout_s=10, sandbox=sandbox) == (STEP_OK, f"{first}\n")
    finally:
        held.release()
