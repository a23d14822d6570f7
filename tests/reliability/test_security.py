"""Security end to end, on real services (tests/core/test_security.py covers the runtime with probe
servicers; this runs the real roles, configured the way `rlfabric serve` configures them):

1. mTLS + bearer token from the config (server.tls.*, server.auth_token_file): a client without a
   cert, with a cert from another CA, or in plaintext is refused; a trusted client without the right
   token gets UNAUTHENTICATED; the right one is served; health answers on the plaintext health port
   (and on the TLS port without a token) for probes. Also the whole `rlfabric up` mesh (slow).
2. No pickle on any wire path: pickles that would create a file if unpickled are sent in every
   field that carries data (tensor bytes, string columns, chat content, reward texts and
   extra_info, custom-function kwargs, PushWeights chunks, whole requests, checkpoint files); the
   file never appears and each answer is OK or a clean refusal.
3. The custom reward sandbox (tests/reward/test_custom_pool.py has timeouts, memory caps, crashes):
   functions that fork, hold a network connection or write files are still cut off by the timeout,
   with their children, even those that left the worker's session (setsid, a double-forked daemon);
   such a daemon also dies when its worker ends (crash, pool closed, service process killed); and
   the service keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from rlfabric.core import codec
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import config_from_dict, default_config_path
from rlfabric.core.server import ServerOptions
from rlfabric.reward.client import RewardClient
from rlfabric.reward.items import STATUS_CRASHED, ScoreItem
from rlfabric.reward.servicer import build_service as build_reward_service
from rlfabric.rollout.servicer import build_service as build_rollout_service
from rlfabric.serve import build_service as build_trainer_service
from rlfabric.v1 import actor_pb2, reward_pb2, rollout_pb2, tensor_pb2
from tests.waiting import wait_until

from .helpers import (
    ACTOR_LOG_PROBS,
    GENERATE,
    LOAD_CHECKPOINT,
    PUSH_WEIGHTS,
    SCORE,
    SERVING,
    Answer,
    Method,
    assert_clean,
    call_raw,
    good_generate_request,
    good_score_request,
    health,
    push_weights_payload,
    sequence_batch,
    trainer_config,
    trainer_request,
)

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token"


def credentials(pki, client: str | None = "client") -> grpc.ChannelCredentials:
    """Trusts the test CA; presents `client`'s cert ("client", "rogue") or none."""
    ca = Path(pki["ca"]).read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=Path(pki[f"{client}_key"]).read_bytes(),
                                        certificate_chain=Path(pki[client]).read_bytes())


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def call_secure(address: str, creds, method: Method, payload, token: str | None = TOKEN, timeout: float = 30) -> Answer:
    channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    with channel:
        return call_raw(channel, method, payload, timeout=timeout, metadata=bearer(token) if token else None)


# --- 1. mTLS + token on real services -------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_config(pki, tiny_model, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("secrets") / "token"
    token_file.write_text(TOKEN + "\n")
    tls = {"cert_file": pki["server"], "key_file": pki["server_key"], "ca_file": pki["ca"], "require_client_cert": True}
    tree = trainer_config(tiny_model).model_dump(mode="json")
    tree["server"].update({"tls": tls, "auth_token_file": str(token_file)})
    return config_from_dict(tree)


@pytest.fixture(scope="module")
def secured(serve_module, secure_config):
    """role -> ServerThread of reward, rollout and actor, each with mTLS, the token and a health port."""
    builders = {"reward": lambda: build_reward_service(secure_config),
                "rollout": lambda: build_rollout_service(secure_config),
                "actor": lambda: build_trainer_service("actor", secure_config)}
    options = lambda: ServerOptions.from_config(secure_config.server, port=0, metrics_port=None, health_port=0)  # noqa: E731
    return {role: serve_module(build(), options()) for role, build in builders.items()}


GOOD = {
    "reward": (SCORE, lambda: good_score_request().SerializeToString()),
    "rollout": (GENERATE, lambda: good_generate_request().SerializeToString()),
    "actor": (ACTOR_LOG_PROBS, lambda: trainer_request(ACTOR_LOG_PROBS, sequence_batch()).SerializeToString()),
}


@pytest.mark.parametrize("role", GOOD)
def test_only_trusted_clients_with_the_token_are_served(secured, pki, role):
    address = secured[role].address
    method, payload = GOOD[role]

    served = call_secure(address, credentials(pki), method, payload())
    assert served.code == grpc.StatusCode.OK, served.details

    for creds, who in ((None, "plaintext"), (credentials(pki, None), "no client cert"),
                       (credentials(pki, "rogue"), "a cert from another CA")):
        refused = call_secure(address, creds, method, payload(), timeout=10)
        assert refused.code == grpc.StatusCode.UNAVAILABLE, f"{who}: {refused.code.name} {refused.details}"

    for token, reason in ((None, "missing bearer token"), ("wrong", "invalid bearer token"),
                          (TOKEN + "x", "invalid bearer token")):
        unauthenticated = call_secure(address, credentials(pki), method, payload(), token=token)
        assert unauthenticated.code == grpc.StatusCode.UNAUTHENTICATED and unauthenticated.details == reason

    # Probes: the plaintext health-only port, and health on the TLS port needs no token.
    server = secured[role].server
    assert health(f"127.0.0.1:{server.health_port}") == SERVING
    assert health(address, credentials=credentials(pki)) == SERVING
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as probe:
        only_health = call_raw(probe, method, payload(), timeout=10)
    assert only_health.code == grpc.StatusCode.UNIMPLEMENTED


def test_the_mesh_clients_use_tls_and_token_from_the_config(secured, secure_config):
    # What the coordinator and the launcher use: ChannelOptions.from_config (the service's own cert
    # as its client identity, the token from server.auth_token_file).
    async def score():
        async with RewardClient(secured["reward"].address, ChannelOptions.from_config(secure_config)) as client:
            return await client.score([ScoreItem("openai/gsm8k", "#### 3", "3")])

    assert [r.score for r in asyncio.run(score())] == [1.0]


def test_garbage_and_pickles_before_authentication_are_refused(secured, pki):
    # Unauthenticated callers get UNAUTHENTICATED whatever they send: nothing is decoded for them.
    address = secured["reward"].address
    for payload in (b"\xff\xfe garbage", pickle.dumps(Evil(Path("/nonexistent/never")))):
        answer = call_secure(address, credentials(pki), SCORE, payload, token=None)
        assert answer.code == grpc.StatusCode.UNAUTHENTICATED


# --- 2. crafted pickles on every data-carrying field ------------------------------------------------------


class Evil:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pickle") / "UNPICKLED"


@pytest.fixture(scope="module")
def pickles(marker) -> dict[str, bytes | str]:
    evil = Evil(marker)
    return {
        "binary": pickle.dumps(evil, protocol=pickle.HIGHEST_PROTOCOL),
        "text": pickle.dumps(evil, protocol=0).decode("ascii"),  # fits a string field
    }


CUSTOM_REWARD = textwrap.dedent(
    """
    import os
    import socket
    import time


    def _child(marker_dir, tag, escape=False, ready=None):
        # In a forked child: leave our pid where the test finds it, then never return.
        if escape:
            os.setsid()  # leave the worker's process group
        with open(os.path.join(marker_dir, f"{tag}-{os.getpid()}"), "w"):
            pass
        if ready is not None:
            os.write(ready, b"x")
        end = time.monotonic() + 30
        while time.monotonic() < end:
            time.sleep(0.05)
        os._exit(0)


    def _daemonize(marker_dir, tag):
        # The classic double fork: the daemon's parent exits at once, so it is orphaned, in a session of its own.
        ready_read, ready_write = os.pipe()
        first = os.fork()
        if first == 0:
            os.setsid()
            if os.fork() == 0:
                _child(marker_dir, tag, ready=ready_write)
            os._exit(0)
        os.waitpid(first, 0)
        os.read(ready_read, 1)  # the daemon runs and has left its marker
        os.close(ready_read)
        os.close(ready_write)


    def compute_score(data_source, solution_str, ground_truth, extra_info, blob=None, marker_dir=""):
        mode = (extra_info or {}).get("mode", "check")
        if mode == "check":
            # Everything arrives as the text that was sent, never as an object rebuilt from it.
            same = [solution_str, ground_truth, extra_info.get("blob"), blob]
            return 1.0 if all(isinstance(x, str) for x in same) and len(set(same)) == 1 else 0.0
        if mode in ("fork_and_hang", "fork_and_return", "escape"):
            if os.fork() == 0:
                _child(marker_dir, mode, escape=mode == "escape")
            if mode == "fork_and_return":
                return 1.0
            time.sleep(60)
        if mode in ("daemon", "daemon_and_return", "daemon_and_crash"):
            _daemonize(marker_dir, mode)
            if mode == "daemon_and_return":
                return 1.0
            if mode == "daemon_and_crash":
                os._exit(3)
            time.sleep(60)
        if mode == "connect":  # a server that accepts and never answers
            socket.create_connection(("127.0.0.1", extra_info["port"])).recv(1)
        if mode == "write":
            with open(extra_info["path"], "ab") as out:
                while True:
                    out.write(b"x" * 65536)
                    out.flush()
        return 1.0
    """
)
CUSTOM_TIMEOUT_S = 1.0


def _shared_directory() -> Path:
    """A directory the sandbox uid may write its markers into (pytest's are root's alone, mode 0700; the
    sandbox's /tmp is its own, so not there)."""
    directory = Path(tempfile.mkdtemp(prefix="rlfabric-sandbox-markers-", dir="/run"))
    directory.chmod(0o1777)
    return directory


@pytest.fixture(scope="module")
def custom_dir():
    directory = _shared_directory()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def marker_dir():
    directory = _shared_directory()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def custom_reward(serve_module, custom_dir, pickles):
    """A reward service scoring with CUSTOM_REWARD, the text pickle in its custom kwargs."""
    path = custom_dir / "reward_fn.py"
    path.write_text(CUSTOM_REWARD)
    config = config_from_dict({"reward": {
        "custom_path": str(path), "num_workers": 1, "timeout_s": CUSTOM_TIMEOUT_S, "memory_limit_mb": 1024,
        "custom_kwargs": {"blob": pickles["text"], "marker_dir": str(custom_dir)}}})
    return serve_module(build_reward_service(config)).address


@pytest.fixture(scope="module")
def plain(serve_module, tiny_model):
    """Plaintext reward, rollout and actor services (what is sent matters here, not who sends it)."""
    config = trainer_config(tiny_model)
    return {"reward": serve_module(build_reward_service(config)).address,
            "rollout": serve_module(build_rollout_service(config)).address,
            "actor": serve_module(build_trainer_service("actor", config)).address}


def send(address: str, method: Method, payload) -> Answer:
    with grpc.insecure_channel(address) as channel:
        return call_raw(channel, method, payload)


def test_pickles_as_whole_requests(plain, pickles, marker):
    for role, method in (("reward", SCORE), ("rollout", GENERATE), ("actor", ACTOR_LOG_PROBS), ("rollout", PUSH_WEIGHTS)):
        payload = [pickles["binary"]] if method.kind == "client_stream" else pickles["binary"]
        answer = send(plain[role], method, payload)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, (method, answer.code, answer.details)
    assert not marker.exists()


def test_pickles_in_tensor_bytes_and_string_columns(plain, pickles, marker):
    batch = codec.encode_batch(sequence_batch())
    evil = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_UINT8, shape=[len(pickles["binary"])], raw_data=pickles["binary"])
    for name in ("input_ids", "attention_mask"):  # wrong byte count, and the right count but a wrong dtype/shape
        for tensor in (tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_INT64, shape=[2, 7], raw_data=pickles["binary"]),
                       evil):
            bad = tensor_pb2.Batch()
            bad.CopyFrom(batch)
            bad.tensors[name].CopyFrom(tensor)
            answer = send(plain["actor"], ACTOR_LOG_PROBS, trainer_request(ACTOR_LOG_PROBS, bad).SerializeToString())
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer.details
    # A string column rides along untouched (the actor reads tensors only).
    batch.columns["note"].values.extend([pickles["text"]] * 2)
    answer = send(plain["actor"], ACTOR_LOG_PROBS, trainer_request(ACTOR_LOG_PROBS, batch).SerializeToString())
    assert answer.code == grpc.StatusCode.OK, answer.details
    assert not marker.exists()


def test_pickles_in_reward_texts_and_extra_info(plain, pickles, marker):
    text = pickles["text"]
    as_json = reward_pb2.ScoreItem(data_source="openai/gsm8k", prompt=text, response=text, ground_truth=text,
                                   extra_info_json=json.dumps({"blob": text}))
    answer = send(plain["reward"], SCORE, reward_pb2.RewardServiceScoreRequest(items=[as_json]).SerializeToString())
    assert answer.code == grpc.StatusCode.OK
    assert reward_pb2.RewardServiceScoreResponse.FromString(answer.responses[0]).results[0].score == 0.0
    raw = reward_pb2.ScoreItem(data_source="openai/gsm8k", response="#### 1", ground_truth="1", extra_info_json=text)
    answer = send(plain["reward"], SCORE, reward_pb2.RewardServiceScoreRequest(items=[raw]).SerializeToString())
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT and "item 0: extra_info_json is not valid JSON" in answer.details
    assert not marker.exists()


def test_pickles_reach_a_custom_function_as_text(custom_reward, pickles, marker):
    # Through the service, the sandbox's JSON pipe and the config's custom_kwargs: the function sees str.
    text = pickles["text"]
    item = reward_pb2.ScoreItem(data_source="x", response=text, ground_truth=text,
                                extra_info_json=json.dumps({"mode": "check", "blob": text}))
    answer = send(custom_reward, SCORE, reward_pb2.RewardServiceScoreRequest(items=[item]).SerializeToString())
    assert answer.code == grpc.StatusCode.OK, answer.details
    result = reward_pb2.RewardServiceScoreResponse.FromString(answer.responses[0]).results[0]
    assert (result.status, result.score) == (reward_pb2.SCORE_STATUS_OK, 1.0), result
    assert not marker.exists()


def test_pickles_in_chat_content(plain, pickles, marker):
    request = good_generate_request()
    request.prompts[0].ClearField("token_ids")
    request.prompts[0].messages.add(role="user", content=pickles["text"])
    answer = send(plain["rollout"], GENERATE, request.SerializeToString())
    assert answer.code == grpc.StatusCode.OK, answer.details
    assert len(rollout_pb2.RolloutServiceGenerateResponse.FromString(answer.responses[0]).samples) == 2
    assert not marker.exists()


def test_pickles_in_push_weights_chunks(plain, pickles, marker):
    data = pickles["binary"]
    for name in ("model.embed_tokens.weight", "not.a.weight"):  # a real weight of the wrong shape; an unknown one
        answer = send(plain["rollout"], PUSH_WEIGHTS, push_weights_payload(data, name=name))
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer.details
        assert name in answer.details
    assert not marker.exists()
    assert_clean(send(plain["rollout"], GENERATE, good_generate_request().SerializeToString()), "Generate after")


def _checkpoint_with_a_pickle(directory: Path, model_dir: Path, marker: Path) -> Path:
    """An actor checkpoint directory whose optimizer.pt is a torch.save()d pickle bomb."""
    directory.mkdir()
    shutil.copy(model_dir / "model.safetensors", directory / "model.safetensors")
    (directory / "meta.json").write_text(json.dumps({"role": "actor", "format_version": 1, "aliases": {}}))
    torch.save({"state": Evil(marker)}, directory / "optimizer.pt")
    torch.save({"updates": 0, "optimizer_steps": 0, "rng": []}, directory / "trainer_state.pt")
    return directory


def _load_checkpoint(plain, path: Path) -> Answer:
    request = actor_pb2.ActorServiceLoadCheckpointRequest()
    request.location.path = str(path)
    return send(plain["actor"], LOAD_CHECKPOINT, request.SerializeToString())


def test_a_checkpoint_holding_a_pickle_bomb_runs_nothing(plain, tiny_model, marker, tmp_path):
    answer = _load_checkpoint(plain, _checkpoint_with_a_pickle(tmp_path / "ckpt", Path(tiny_model), marker))
    assert answer.code != grpc.StatusCode.OK
    assert not marker.exists()  # torch.load(weights_only=True) refused the pickle
    assert_clean(send(plain["actor"], ACTOR_LOG_PROBS, GOOD["actor"][1]()), "ComputeLogProbs after")


def test_a_checkpoint_holding_a_pickle_bomb_is_a_clean_refusal(plain, tiny_model, marker, tmp_path):
    directory = _checkpoint_with_a_pickle(tmp_path / "ckpt", Path(tiny_model), marker)
    answer = _load_checkpoint(plain, directory)
    assert answer.code == grpc.StatusCode.FAILED_PRECONDITION and str(directory) in answer.details


# --- 3. the custom reward sandbox -----------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def _children(directory: Path, tag: str) -> list[int]:
    return [int(p.name.split("-")[-1]) for p in directory.glob(f"{tag}-*")]


def score_one(address: str, extra_info: dict) -> tuple[reward_pb2.ScoreResult, float]:
    item = reward_pb2.ScoreItem(data_source="x", response="r", ground_truth="g", extra_info_json=json.dumps(extra_info))
    answer = send(address, SCORE, reward_pb2.RewardServiceScoreRequest(items=[item]).SerializeToString())
    assert answer.code == grpc.StatusCode.OK, answer.details
    return reward_pb2.RewardServiceScoreResponse.FromString(answer.responses[0]).results[0], answer.seconds


def assert_next_item_is_scored(address: str) -> None:
    """The service goes on: a plain item right after is scored (by a fresh worker)."""
    result, _ = score_one(address, {"mode": "fork_and_return"})
    assert result.status == reward_pb2.SCORE_STATUS_OK and result.score == 1.0, result


def test_a_function_that_forks_and_hangs_is_cut_off_with_its_child(custom_reward, custom_dir):
    result, seconds = score_one(custom_reward, {"mode": "fork_and_hang"})
    children = _children(custom_dir, "fork_and_hang")
    assert len(children) == 1
    wait_until(lambda: not _alive(children[0]), 10, "the forked child to die with the timed-out worker")
    assert result.status == reward_pb2.SCORE_STATUS_TIMEOUT and seconds < CUSTOM_TIMEOUT_S + 5
    assert_next_item_is_scored(custom_reward)


def test_a_function_cannot_reach_the_network(custom_reward):
    """User code runs in a network namespace of its own: a listening service on this machine is unreachable
    (ENETUNREACH at once), not merely slow to answer."""
    with socket.socket() as server:  # accepts connections (the kernel does), never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        result, seconds = score_one(custom_reward, {"mode": "connect", "port": server.getsockname()[1]})
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached it
    assert result.status == reward_pb2.SCORE_STATUS_ERROR and "unreachable" in result.message, result
    assert seconds < CUSTOM_TIMEOUT_S + 5
    assert_next_item_is_scored(custom_reward)


def test_a_function_writing_without_end_hits_the_file_size_limit(custom_reward, custom_dir):
    out = custom_dir / "flood"
    result, seconds = score_one(custom_reward, {"mode": "write", "path": str(out)})
    assert result.status == reward_pb2.SCORE_STATUS_ERROR and "File too large" in result.message, result
    assert seconds < CUSTOM_TIMEOUT_S + 5
    assert out.stat().st_size <= 64 << 20  # reward.custom_sandbox.max_file_mb
    assert_next_item_is_scored(custom_reward)


def test_what_a_finished_function_started_dies_with_its_item(tmp_path, marker_dir):
    """A double-forked daemon (a session of its own) that the function left running when it returned is
    killed and reaped before the item's result comes back: it cannot read the next items."""
    from rlfabric.reward.custom import CustomScorerPool

    path = tmp_path / "reward_fn.py"
    path.write_text(CUSTOM_REWARD)
    with _no_survivors(marker_dir, "daemon_and_return"):
        with CustomScorerPool(str(path), num_workers=1, timeout_s=5,
                              function_kwargs={"marker_dir": str(marker_dir)}) as pool:
            result = pool.score_batch([ScoreItem("x", "r", "g", extra_info={"mode": "daemon_and_return"})])[0]
            assert result.ok and result.score == 1.0
            (daemon,) = _children(marker_dir, "daemon_and_return")  # left before the function returned
            assert not _alive(daemon)
            assert_pool_scores(pool)


def assert_pool_scores(pool) -> None:
    result = pool.score_batch([ScoreItem("x", "r", "g", extra_info={"mode": "plain"})])[0]
    assert result.ok and result.score == 1.0, result


@contextlib.contextmanager
def _no_survivors(directory: Path, tag: str):
    """Kills the tagged children left running, whatever happened (a failed test must not leave any)."""
    try:
        yield
    finally:
        for pid in _children(directory, tag):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_that_leaves_the_process_group_is_cut_off_too(custom_reward, custom_dir):
    with _no_survivors(custom_dir, "escape"):
        result, seconds = score_one(custom_reward, {"mode": "escape"})
        assert result.status == reward_pb2.SCORE_STATUS_TIMEOUT and seconds < CUSTOM_TIMEOUT_S + 5, result
        wait_until(lambda: _children(custom_dir, "escape"), 10, "the escaped children's markers")
        wait_until(lambda: not any(_alive(pid) for pid in _children(custom_dir, "escape")), 3, "the escaped children to die")
        assert_next_item_is_scored(custom_reward)


def test_a_double_forked_daemon_is_cut_off_with_the_timeout(custom_reward, custom_dir):
    with _no_survivors(custom_dir, "daemon"):
        result, seconds = score_one(custom_reward, {"mode": "daemon"})
        assert result.status == reward_pb2.SCORE_STATUS_TIMEOUT and seconds < CUSTOM_TIMEOUT_S + 5, result
        daemons = _children(custom_dir, "daemon")
        assert len(daemons) == 1
        wait_until(lambda: not _alive(daemons[0]), 3, "the daemon to die with the timed-out worker")
        assert_next_item_is_scored(custom_reward)


def test_a_double_forked_daemon_dies_with_its_crashed_worker(tmp_path, marker_dir):
    from rlfabric.reward.custom import CustomScorerPool

    path = tmp_path / "reward_fn.py"
    path.write_text(CUSTOM_REWARD)
    with _no_survivors(marker_dir, "daemon_and_crash"):
        with CustomScorerPool(str(path), num_workers=1, timeout_s=5,
                              function_kwargs={"marker_dir": str(marker_dir)}) as pool:
            crashed = pool.score_batch([ScoreItem("x", "r", "g", extra_info={"mode": "daemon_and_crash"})])[0]
            assert crashed.status == STATUS_CRASHED and "exited with code 3" in crashed.message, crashed
            (daemon,) = _children(marker_dir, "daemon_and_crash")
            wait_until(lambda: not _alive(daemon), 3, "the daemon to die with the crashed worker")
            assert_pool_scores(pool)  # a fresh worker


def test_a_double_forked_daemon_dies_when_the_pool_process_is_killed(tmp_path, marker_dir):
    """The service process itself dies (SIGKILL, OOM kill) while an item runs: the orphaned worker kills
    what its function started."""
    path = tmp_path / "reward_fn.py"
    path.write_text(CUSTOM_REWARD)
    script = textwrap.dedent(f"""
        from rlfabric.reward.custom import CustomScorerPool
        from rlfabric.reward.items import ScoreItem
        pool = CustomScorerPool({str(path)!r}, num_workers=1, timeout_s=60,
                                function_kwargs={{"marker_dir": {str(marker_dir)!r}}})
        pool.score_batch([ScoreItem("x", "r", "g", extra_info={{"mode": "daemon"}})])
        """)
    with _no_survivors(marker_dir, "daemon"):
        service = subprocess.Popen([sys.executable, "-c", script])
        try:
            wait_until(lambda: len(_children(marker_dir, "daemon")) == 1, 20, "the daemon's marker")
            daemon = _children(marker_dir, "daemon")[0]
            assert _alive(daemon)  # the item is still running
        finally:
            service.kill()
            service.wait()
        wait_until(lambda: not _alive(daemon), 5, "the daemon to die with the killed pool process")


# --- 1b. the whole local mesh under mTLS + token (slow: six service processes) ---------------------------

STATUS_OF_ROLE = {
    "actor": Method("rlfabric.v1.ActorService", "GetStatus", "unary"),
    "reference": Method("rlfabric.v1.ReferenceService", "GetStatus", "unary"),
    "critic": Method("rlfabric.v1.CriticService", "GetStatus", "unary"),
    "rollout": Method("rlfabric.v1.RolloutService", "GetStatus", "unary"),
    "reward": Method("rlfabric.v1.RewardService", "GetStatus", "unary"),
    "coordinator": Method("rlfabric.v1.CoordinatorService", "GetRunStatus", "unary"),
}


@pytest.fixture(scope="module")
def secure_mesh(pki, tmp_path_factory):
    """`rlfabric up` with the quickstart plus server.tls (mTLS) and server.auth_token_file, as PPO with a KL
    loss so that every role runs (a critic for GAE, a reference for the KL term)."""
    d = tmp_path_factory.mktemp("secure-mesh")
    (d / "token").write_text(TOKEN + "\n")
    config = d / "mesh.yaml"
    config.write_text(default_config_path().read_text() + textwrap.dedent(f"""
        server:
          tls: {{cert_file: {pki['server']}, key_file: {pki['server_key']}, ca_file: {pki['ca']},
                 require_client_cert: true}}
          auth_token_file: {d / 'token'}
        """))
    run_dir = d / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "rlfabric", "up", str(config), "--run-dir", str(run_dir),
                                 "algorithm.adv_estimator=gae", "actor.use_kl_loss=true"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    drain = threading.Thread(target=lambda: output.extend(launcher.stdout), daemon=True)
    drain.start()
    deadline = time.monotonic() + 300
    while not any("mesh ready" in line for line in output):
        if launcher.poll() is not None:
            drain.join(timeout=10)  # the rest of its output
            pytest.fail(f"rlfabric up exited {launcher.returncode} under mTLS: {''.join(output)[-3000:]}")
        assert time.monotonic() < deadline, "the mTLS mesh did not come up in 300 s"
        time.sleep(0.2)
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    yield run_dir, endpoints
    launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(timeout=60)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()


@pytest.mark.slow
def test_the_mesh_runs_under_mtls_and_refuses_outsiders(secure_mesh, pki):
    # The mesh came up: the launcher's readiness checks and the coordinator's config used TLS + token.
    _, endpoints = secure_mesh
    assert set(endpoints) == set(STATUS_OF_ROLE)
    for role, method in STATUS_OF_ROLE.items():
        address = endpoints[role][0]["grpc"]
        assert call_secure(address, credentials(pki), method, b"").code == grpc.StatusCode.OK, role
        assert call_secure(address, credentials(pki), method, b"", token=None).code == grpc.StatusCode.UNAUTHENTICATED
        for creds in (None, credentials(pki, None), credentials(pki, "rogue")):
            assert call_secure(address, creds, method, b"", timeout=10).code == grpc.StatusCode.UNAVAILABLE, role
        assert health(address, credentials=credentials(pki)) == SERVING


@pytest.mark.slow
def test_status_command_works_under_mtls(secure_mesh):
    run_dir, _ = secure_mesh
    out = subprocess.run([sys.executable, "-m", "rlfabric", "status", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
