"""The custom reward sandbox as a security boundary: each attack a user's function (or code it runs)
could make, made for real against a pool running as root, and the pool scoring the next batch after it."""

import asyncio
import errno
import os
import secrets
import shutil
import socket
import stat
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest

from rlfabric.core.config import CustomSandboxConfig, RewardConfig
from rlfabric.reward import (
    STATUS_CRASHED,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    CustomScorerPool,
    ScoreItem,
)
from rlfabric.reward.engine import RewardEngine
from rlfabric.sandbox.confine import INTERPRETER_VARIABLES

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the sandbox's uid and network boundary need root"
)

TIMEOUT_S = 1.0
NUM_WORKERS = 2
# A uid range no other process has, so every process of it is the sandbox's; each worker takes one.
SANDBOX_UID = 3_000_000 + os.getpid() % 100_000 * 16
UID_COUNT = 16
SANDBOX_UIDS = range(SANDBOX_UID, SANDBOX_UID + UID_COUNT)
MAX_PROCESSES = 32
LEFTOVERS = 12  # processes an item leaves running: three items' worth would pass MAX_PROCESSES
API_KEY = "sk-test-4f1c9e7d2b"
SECRET_VARIABLE = "RLFABRIC_TEST_SERVICE_SECRET"
PASSED_VARIABLE = "RLFABRIC_TEST_PASSED_ON"

USER_FILE = textwrap.dedent(
    """
    import ctypes
    import json
    import os
    import select
    import signal
    import socket
    import sys
    import time

    FORGED = b'{"type": "result", "value": 1000000000.0}\\n'


    def fork(how):
        if how == "libc":  # as C code would: no os.register_at_fork handler runs
            return ctypes.PyDLL(None).fork()
        return os.fork()


    def read_everything(marker, ready):
        # In a process left running: say so, then read whatever comes on any descriptor it holds.
        ready_read, ready_write = ready
        os.close(ready_read)
        os.write(ready_write, b"x")
        end = time.monotonic() + 30
        with open(marker, "ab") as out:
            while time.monotonic() < end:
                for fd in range(3, 64):
                    try:
                        if select.select([fd], [], [], 0)[0]:
                            out.write(os.read(fd, 65536))
                            out.flush()
                    except (OSError, ValueError):
                        pass
                time.sleep(0.005)
        os._exit(0)


    def write_everywhere(data):
        paths = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
        paths += [f"/proc/{os.getppid()}/fd/{fd}" for fd in ("0", "1", "2", "3", "4", "5")]
        for path in paths:
            try:
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, data)
            except OSError:
                pass
        for fd in range(64):  # and every descriptor number this process holds
            try:
                os.write(fd, data)
            except OSError:
                pass


    def failure(call):
        try:
            call()
        except OSError as exc:
            return {"score": 0.0, "errno": exc.errno}
        return 1.0


    def compute_score(data_source, solution_str, ground_truth, extra_info, api_key=""):
        mode = extra_info["mode"]
        if mode == "exact":
            return float(solution_str == ground_truth)
        if mode == "identity":
            cwd = os.getcwd()
            return {"score": 1.0, "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
                    "groups": len(os.getgroups()), "cwd_owner": os.stat(cwd).st_uid,
                    "home_is_cwd": os.environ["HOME"] == cwd, "cwd_entries": len(os.listdir(cwd))}
        if mode == "connect":
            client = socket.socket()
            client.settimeout(5)
            return failure(lambda: client.connect(("127.0.0.1", extra_info["port"])))
        if mode == "read":
            return failure(lambda: open(extra_info["path"], "rb").read())
        if mode == "signal":
            return failure(lambda: os.kill(extra_info["pid"], signal.SIGKILL))
        if mode == "environment":
            name = extra_info["name"]
            seen = [name in os.environ]
            for path in ("/proc/self/environ", f"/proc/{os.getppid()}/environ"):
                try:
                    seen.append(name.encode() in open(path, "rb").read())
                except OSError:
                    pass
            return {"score": float(any(seen)), "passed": os.environ.get(extra_info["passed"]) == "on",
                    "configured": os.environ.get("REWARD_MODE") == "sandboxed",
                    "others": len(set(os.environ) - set(extra_info["expected"]))}
        if mode == "kwargs":
            return float(api_key == extra_info["expected"])
        if mode == "forge_stdout":
            print(FORGED.decode(), end="", flush=True)
            os.write(1, FORGED)
            return 0.25
        if mode == "forge_descriptors":
            write_everywhere(FORGED)
            return 0.25
        if mode == "forge_from_child":
            # A process the function starts, which knows the protocol and finds the item's nonce.
            frame = sys._getframe()
            while "nonce" not in frame.f_locals:
                frame = frame.f_back
            reply = {"type": "result", "value": 1e9, "nonce": frame.f_locals["nonce"]}
            child = fork(extra_info["how"])
            if child == 0:
                write_everywhere(json.dumps(reply).encode() + b"\\n")
                os._exit(0)
            os.waitpid(child, 0)
            return 0.25
        if mode == "count_processes":
            read_end, write_end = os.pipe()
            children = []
            try:
                while len(children) < 1000:
                    child = os.fork()
                    if child == 0:
                        os.close(write_end)
                        os.read(read_end, 1)  # until the parent closes its end
                        os._exit(0)
                    children.append(child)
            except OSError as exc:
                limit_errno = exc.errno
            os.close(write_end)
            for child in children:
                os.waitpid(child, 0)
            return {"score": float(len(children)), "errno": limit_errno}
        if mode == "leave_children":
            # Children that outlive the item (half of them forked as C code would), each reading all it can.
            ready = os.pipe()
            forked = 0
            try:
                for n in range(extra_info["count"]):
                    if fork("libc" if n % 2 else "os") == 0:
                        read_everything(os.path.join(extra_info["dir"], f"leftover-{os.getpid()}"), ready)
                    forked += 1
            except OSError as exc:
                return {"score": float(forked), "errno": exc.errno}
            for _ in range(forked):
                os.read(ready[0], 1)
            return float(forked)
        if mode == "hog_children":
            children = []
            for _ in range(extra_info["count"]):
                child = os.fork()
                if child == 0:
                    hog = bytearray(extra_info["mib"] * 1024 * 1024)
                    for offset in range(0, len(hog), 4096):  # resident, not merely reserved
                        hog[offset] = 1
                    time.sleep(60)
                    os._exit(0)
                children.append(child)
            for child in children:
                os.waitpid(child, 0)
            return 1.0
        if mode == "fork_bomb":
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        if mode == "burn":
            start = time.process_time()
            while time.process_time() - start < extra_info["cpu_s"]:
                pass
            return 1.0
        if mode == "spin":
            while True:
                pass
        if mode == "temp_files":  # write the names (unless told to read only); which of them exist
            names = extra_info["names"]
            if extra_info["write"]:
                for name in names:
                    with open(name, "w") as file:
                        file.write("left by an earlier call")
            return {"score": 1.0, **{str(n): float(os.path.exists(name)) for n, name in enumerate(names)}}
        if mode == "big_file":
            with open("big.bin", "wb") as file:
                for _ in range(extra_info["mib"]):
                    file.write(bytes(1024 * 1024))
            return 1.0
        raise AssertionError(mode)
    """
)


def item(mode: str, response: str = "42", **extra) -> ScoreItem:
    return ScoreItem("my/task", response, "42", extra_info={"mode": mode, **extra})


def score(pool: CustomScorerPool, mode: str, **extra):
    return pool.score_batch([item(mode, **extra)])[0]


def assert_next_batch_works(pool: CustomScorerPool) -> None:
    results = pool.score_batch([item("exact"), item("exact", response="41"), item("exact"), item("exact")])
    assert [(r.status, r.score) for r in results] == [(STATUS_OK, 1.0), (STATUS_OK, 0.0)] + [
        (STATUS_OK, 1.0)
    ] * 2


def sandbox_processes() -> list[psutil.Process]:
    """Every process of the sandbox's uids, zombies included."""
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in SANDBOX_UIDS]


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"  # in a 0700 directory of root's
    path.write_text(USER_FILE)
    return str(path)


@pytest.fixture(scope="module")
def service_environment():
    os.environ[SECRET_VARIABLE] = "service-only"
    os.environ[PASSED_VARIABLE] = "on"
    yield
    del os.environ[SECRET_VARIABLE], os.environ[PASSED_VARIABLE]


def sandbox_config(**fields) -> CustomSandboxConfig:
    return CustomSandboxConfig(
        uid=SANDBOX_UID,
        uid_count=UID_COUNT,
        gid=SANDBOX_UID,
        require_network_isolation=True,
        env={"REWARD_MODE": "sandboxed"},
        env_passthrough=[PASSED_VARIABLE],
        max_processes=MAX_PROCESSES,
        max_file_mb=1,
        **fields,
    )


@pytest.fixture(scope="module")
def pool(user_file, service_environment):
    with CustomScorerPool(
        user_file,
        num_workers=NUM_WORKERS,
        timeout_s=TIMEOUT_S,
        memory_limit_mb=1024,
        function_kwargs={"api_key": API_KEY},
        sandbox=sandbox_config(),
    ) as pool:
        yield pool
    assert sandbox_processes() == []  # close() left nothing of the sandbox uid running


def test_each_worker_runs_as_a_uid_of_its_own_in_a_private_directory(pool):
    both = [result.metrics for result in pool.score_batch([item("identity"), item("identity")])]  # one per worker
    assert len({metrics["uid"] for metrics in both}) == NUM_WORKERS
    for metrics in both:
        assert metrics["uid"] in SANDBOX_UIDS and metrics["euid"] == metrics["uid"]
        assert metrics["gid"] == SANDBOX_UID and metrics["groups"] == 0
        assert metrics["cwd_owner"] == metrics["uid"] and metrics["home_is_cwd"] == 1.0


def test_no_network(pool):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        result = score(pool, "connect", port=listener.getsockname()[1])
        assert (result.status, result.score) == (STATUS_OK, 0.0)
        assert result.metrics["errno"] == errno.ENETUNREACH  # no route at all, not merely refused
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the listener
    assert_next_batch_works(pool)


def test_network_when_allowed(user_file):
    # The same function does connect where the config lets it: the test above fails for the right reason.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with CustomScorerPool(user_file, num_workers=1, sandbox=sandbox_config(allow_network=True)) as pool:
            result = score(pool, "connect", port=listener.getsockname()[1])
        assert (result.status, result.score) == (STATUS_OK, 1.0)
        listener.accept()[0].close()


@pytest.fixture
def open_directory():
    """A new directory every uid may list (pytest's are root's alone), in /run: the sandbox's /tmp is its own."""
    directory = Path(tempfile.mkdtemp(prefix="rlfabric-test-", dir="/run"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


def test_cannot_read_root_only_files(pool, open_directory):
    directory = open_directory  # the file's own mode is what stops the function, not its directory
    token, public = directory / "token", directory / "public"
    token.write_text("bearer-token")
    token.chmod(stat.S_IRUSR | stat.S_IWUSR)
    public.write_text("anyone may read this")
    public.chmod(0o644)
    denied = score(pool, "read", path=str(token))
    assert (denied.status, denied.score, denied.metrics["errno"]) == (STATUS_OK, 0.0, errno.EACCES)
    assert score(pool, "read", path=str(public)).score == 1.0
    assert_next_batch_works(pool)


def live_children(recursive: bool = False) -> list[psutil.Process]:
    """This process's children that still run: earlier tests of the session may leave others, exited but
    not yet reaped (zombies have no command line or environment to read)."""
    return [child for child in psutil.Process().children(recursive=recursive)
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]


def supervisor_pids() -> list[int]:
    # Only the pool's workers: earlier tests of the session may leave other children (a resource tracker).
    return [child.pid for child in live_children() if "custom_worker" in " ".join(child.cmdline())]


def test_cannot_signal_the_supervisor_or_the_service(pool):
    supervisors = supervisor_pids()
    assert len(supervisors) == NUM_WORKERS
    for pid in [*supervisors, os.getpid()]:
        result = score(pool, "signal", pid=pid)
        assert (result.score, result.metrics["errno"]) == (0.0, errno.EPERM)
    assert supervisor_pids() == supervisors  # all alive, none replaced


def test_environment_is_empty_but_for_the_configured(pool):
    expected = ["PATH", "HOME", "TMPDIR", "REWARD_MODE", PASSED_VARIABLE, *INTERPRETER_VARIABLES]
    result = score(pool, "environment", name=SECRET_VARIABLE, passed=PASSED_VARIABLE, expected=expected)
    assert result.score == 0.0  # not in os.environ, nor in the scorer's or supervisor's /proc/PID/environ
    assert result.metrics == {"passed": 1.0, "configured": 1.0, "others": 0.0}
    for child in live_children(recursive=True):  # read as root: the workers never had it
        assert SECRET_VARIABLE not in child.environ()


def test_keyword_arguments_reach_the_function_but_no_command_line(pool):
    assert score(pool, "kwargs", expected=API_KEY).score == 1.0
    command_lines = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    assert any("rlfabric.reward.custom_worker" in line for line in command_lines)
    assert not any(API_KEY in line for line in command_lines)


def test_prints_to_stdout_forge_nothing(pool):
    result = score(pool, "forge_stdout")
    assert (result.status, result.score) == (STATUS_OK, 0.25)
    assert_next_batch_works(pool)


def test_writes_to_every_descriptor_forge_nothing(pool):
    result = score(pool, "forge_descriptors")
    assert result.status == STATUS_ERROR and result.score == 0.0
    assert "broke the result protocol (a reply without the item's nonce)" in result.message
    assert_next_batch_works(pool)


def test_a_child_process_cannot_answer_for_the_function(pool):
    # Forked by os.fork, it finds the channel's descriptor on /dev/null: its forgery goes nowhere.
    result = score(pool, "forge_from_child", how="os")
    assert (result.status, result.score) == (STATUS_OK, 0.25)
    # Forked as C code would, it has the channel, but the supervisor takes replies from the scorer's pid only.
    result = score(pool, "forge_from_child", how="libc")
    assert result.status == STATUS_ERROR and result.score == 0.0
    assert "wrote on the result channel, not the scorer" in result.message
    assert_next_batch_works(pool)


@pytest.fixture
def shared_directory():
    """A new directory every uid may write to (pytest's are root's alone)."""
    directory = Path(tempfile.mkdtemp())
    directory.chmod(0o1777)
    yield directory
    shutil.rmtree(directory)


def test_nothing_an_item_starts_outlives_it(user_file, shared_directory):
    # (A timeout far off: forking a dozen interpreters takes a while on a busy machine.) The host's /tmp, where
    # the leftovers' markers must land for this test to read them.
    with CustomScorerPool(user_file, num_workers=NUM_WORKERS, timeout_s=30,
                          sandbox=sandbox_config(private_tmp=False)) as pool:
        supervisors = set(supervisor_pids())
        for _ in range(3):  # each item forks as many: no leftover, nor zombie, uses up RLIMIT_NPROC
            result = score(pool, "leave_children", count=LEFTOVERS, dir=str(shared_directory))
            assert (result.status, result.score) == (STATUS_OK, float(LEFTOVERS)), result
            # Killed and reaped before the result came back: of the sandbox's uids only scorers are left
            # (this pool's, and the module's pool's), no zombie.
            assert [p.status() for p in sandbox_processes()].count(psutil.STATUS_ZOMBIE) == 0
            assert sandbox_processes_but_scorers() == []
        # So no leftover reads the next items off the channel, ground truth included.
        secret = secrets.token_hex(16)
        results = pool.score_batch([ScoreItem("my/task", secret, secret, extra_info={"mode": "exact"})] * 4)
        assert [(r.status, r.score) for r in results] == [(STATUS_OK, 1.0)] * 4
        markers = list(shared_directory.glob("leftover-*"))
        assert len(markers) == 3 * LEFTOVERS
        assert not any(secret.encode() in marker.read_bytes() for marker in markers)
        assert set(supervisor_pids()) == supervisors  # the same workers all along


@pytest.mark.parametrize("private_tmp", [True, False], ids=["private", "cleared"])
def test_no_call_sees_the_temp_files_of_an_earlier_one(user_file, private_tmp):
    token = secrets.token_hex(8)
    names = [f"/tmp/x-{token}", f"/var/tmp/v-{token}", f"/dev/shm/y-{token}", f"in-the-working-directory-{token}"]
    with CustomScorerPool(user_file, num_workers=1, sandbox=sandbox_config(private_tmp=private_tmp)) as pool:
        assert not any("no private" in warning for warning in pool.sandbox_warnings)
        written = score(pool, "temp_files", names=names, write=True)
        assert written.status == STATUS_OK and [written.metrics[str(n)] for n in range(4)] == [1.0] * 4
        assert not any(os.path.exists(name) for name in names[:3])  # the host's never had them (or no longer)
        later = score(pool, "temp_files", names=names, write=False)  # the same worker, the next call
        assert later.status == STATUS_OK and [later.metrics[str(n)] for n in range(4)] == [0.0] * 4


@pytest.mark.parametrize("memory_cgroup", [True, False], ids=["cgroup", "counted"])
def test_the_memory_limit_holds_for_all_the_processes_together(user_file, memory_cgroup):
    # Four children of 144 MiB each pass no one's RLIMIT_AS of 256 MiB (the scorer's own is ~100), but
    # 576 MiB together.
    with CustomScorerPool(user_file, num_workers=1, timeout_s=20, memory_limit_mb=256,
                          sandbox=sandbox_config(memory_cgroup=memory_cgroup)) as pool:
        assert not any("no memory cgroup" in warning for warning in pool.sandbox_warnings)
        result = score(pool, "hog_children", count=4, mib=144)
        assert result.status == STATUS_ERROR and result.score == 0.0, result
        assert "went past its memory limit of 256 MiB" in result.message
        assert_next_batch_works(pool)  # a fresh worker
        assert sandbox_processes_but_scorers() == []


def sandbox_processes_but_scorers() -> list[psutil.Process]:
    supervisors = set(supervisor_pids())
    return [p for p in sandbox_processes() if p.ppid() not in supervisors]


def test_process_limit(pool):
    result = score(pool, "count_processes")
    assert result.status == STATUS_OK
    assert 0 < result.score < MAX_PROCESSES and result.metrics["errno"] == errno.EAGAIN
    assert_next_batch_works(pool)


def test_fork_bomb_is_contained_and_cleaned_up(pool):
    result = score(pool, "fork_bomb")
    assert result.status == STATUS_TIMEOUT and result.score == 0.0
    assert_next_batch_works(pool)
    # Only the scorers are left of the sandbox uid, each the child of a live supervisor of this pool.
    # Of the sandbox uid, only scorers are left (a replacement may still be starting): each the child
    # of a live supervisor; a survivor of the bomb would have been reparented away from them.
    supervisors = {child.pid for child in psutil.Process().children()}
    left = sandbox_processes()
    assert len(left) <= NUM_WORKERS and all(process.ppid() in supervisors for process in left)


def test_file_size_limit(pool):
    result = score(pool, "big_file", mib=2)
    assert result.status == STATUS_ERROR and "File too large" in result.message
    assert_next_batch_works(pool)


def test_cpu_limit_is_renewed_per_item(user_file):
    # The wall-clock timeout is far off: on a busy machine a CPU second takes longer than a second.
    with CustomScorerPool(
        user_file, num_workers=1, timeout_s=60, sandbox=sandbox_config(cpu_limit_s=1)
    ) as pool:
        # 1.2 CPU seconds in all, 0.4 per item: each item gets its own second.
        results = pool.score_batch([item("burn", cpu_s=0.4)] * 3)
        assert [r.status for r in results] == [STATUS_OK] * 3
        result = score(pool, "spin")
        assert result.status == STATUS_CRASHED and "SIGXCPU" in result.message  # not the timeout
        assert_next_batch_works(pool)


def test_the_reward_service_confines_as_its_config_says(user_file):
    config = RewardConfig(custom_path=user_file, custom_sandbox=sandbox_config())
    engine = RewardEngine(config)
    asyncio.run(engine.start())
    try:
        assert score(engine.custom_pool, "identity").metrics["uid"] in SANDBOX_UIDS
    finally:
        asyncio.run(engine.stop())


def test_installed_modules_the_file_imports_work_in_the_sandbox(tmp_path):
    """The sandbox uid may be unable to read the interpreter's own files (on this machine Python lives
    under /root, mode 0700): the installed modules the file names are imported before the drop."""
    path = tmp_path / "uses_the_standard_library.py"
    path.write_text(textwrap.dedent(
        """
        import difflib
        from fractions import Fraction


        def compute_score(data_source, solution_str, ground_truth, extra_info):
            import statistics

            same = difflib.SequenceMatcher(None, solution_str, ground_truth).ratio()
            return float(same * Fraction(1, 2) * 2 * statistics.mean([1, 1]))
        """))
    with CustomScorerPool(str(path), num_workers=1, sandbox=sandbox_config()) as pool:
        result = pool.score_batch([ScoreItem("my/task", "42", "42")])[0]
    assert (result.status, result.score) == (STATUS_OK, 1.0), result.message
