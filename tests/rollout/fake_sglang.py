"""FakeSGLangServer: a stand-in for an SGLang server, written for these tests (SGLang cannot run without
a GPU). It answers the HTTP endpoints the adapter calls the way SGLang documents them and records the
exact JSON it was sent.

- /generate answers the prompt's last token + 1, repeated max_new_tokens times (finish "length"), with
  log-prob -0.25 each.
- Weight updates behave as SGLang's do: /init_weights_update_group joins the trainer's process group as
  SGLang builds it (torch's tcp:// rendezvous at master_address:master_port, rank rank_offset, keys under
  PrefixStore(group_name)); /update_weights_from_distributed receives broadcasts from rank 0 of that group,
  one flat uint8 buffer of the tensors back to back with load_format "flattened_bucket", else one
  broadcast per tensor, and keeps what arrived (read back with /get_weights_by_name). A failed update
  answers HTTP 400 {"success": false, "message": ...}, as SGLang's server does.
- Its own endpoints (not SGLang's): GET /fake/calls (the calls so far), POST /fake/fail_next_update
  {"message": ...} (the next weight update receives its bytes, then fails as a load_weights error would).

A test process that also hosts the actor cannot host the fake's process group too (torch keeps one group
per name in a process): run it in a process of its own with `python -m tests.rollout.fake_sglang PORT_FILE`.
"""

from __future__ import annotations

import json
import sys
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeSGLangServer:
    def __init__(self):
        self.calls: list[tuple[str, str, dict | None]] = []
        self.fail_generate: tuple[int, str] | None = None  # (HTTP status, body) to answer /generate with
        self.fail_next_update = ""  # a weight update's failure message, once
        self.weight_version = "7"
        self.groups: dict[str, object] = {}  # group name -> torch process group
        self.weights: dict[str, object] = {}  # name -> the latest tensor received
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, payload) -> None:
                body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/fake/calls":
                    return self._answer(200, fake.calls)
                fake.calls.append(("GET", self.path, None))
                if self.path == "/get_weight_version":
                    return self._answer(200, {"weight_version": fake.weight_version})
                return self._answer(200, {})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                if self.path == "/fake/fail_next_update":
                    fake.fail_next_update = payload["message"]
                    return self._answer(200, {})
                fake.calls.append(("POST", self.path, payload))
                if self.path == "/generate":
                    return self._answer(*fake.generate(payload))
                if self.path == "/init_weights_update_group":
                    return self._answer(*fake.outcome(fake.join_group, payload))
                if self.path == "/update_weights_from_distributed":
                    return self._answer(*fake.outcome(fake.receive, payload))
                if self.path == "/destroy_weights_update_group":
                    return self._answer(*fake.outcome(fake.leave_group, payload))
                if self.path == "/get_weights_by_name":
                    tensor = fake.weights[payload["name"]]
                    return self._answer(200, tensor.flatten()[: payload.get("truncate_size", 100)].tolist())
                return self._answer(200, {"success": True, "message": ""})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def posts(self, path: str) -> list[dict]:
        return [payload for method, p, payload in self.calls if method == "POST" and p == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- generation --------------------------------------------------------------------------------

    def generate(self, payload: dict) -> tuple[int, object]:
        if self.fail_generate:
            return self.fail_generate
        count = payload["sampling_params"]["max_new_tokens"]
        token = (payload["input_ids"][-1] + 1) % 100
        meta = {"id": payload["rid"], "finish_reason": {"type": "length", "length": count},
                "output_token_logprobs": [[-0.25, token, None]] * count}
        return 200, {"text": "x" * count, "output_ids": [token] * count, "meta_info": meta}

    # -- weight updates, as SGLang's ModelRunner does them ------------------------------------------

    @staticmethod
    def outcome(action, payload: dict) -> tuple[int, dict]:
        try:
            message = action(payload)
        except Exception as error:  # SGLang answers a failed update with 400 and its message
            return 400, {"success": False, "message": f"{type(error).__name__}: {error}"}
        return 200, {"success": True, "message": message}

    def join_group(self, payload: dict) -> str:
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            rendezvous,
        )

        timeout = timedelta(seconds=60)
        address = f"tcp://{payload['master_address']}:{payload['master_port']}"
        store, rank, world_size = next(rendezvous(address, payload["rank_offset"], payload["world_size"], timeout=timeout))
        store.set_timeout(timeout)
        name = payload["group_name"]
        self.groups[name], _ = _new_process_group_helper(world_size, rank, [], Backend(payload["backend"]),
                                                         PrefixStore(name, store), group_name=name, timeout=timeout)
        return "Succeeded to initialize custom process group."

    def receive(self, payload: dict) -> str:
        import torch
        import torch.distributed as dist

        group = self.groups[payload["group_name"]]
        dtypes = [getattr(torch, name) for name in payload["dtypes"]]
        shapes = [tuple(shape) for shape in payload["shapes"]]
        sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
        if payload.get("load_format") == "flattened_bucket":
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            dist.broadcast(flat, group_src=0, group=group)
            received, start = [], 0
            for size, dtype, shape in zip(sizes, dtypes, shapes, strict=True):
                received.append(flat[start : start + size].view(dtype).view(shape).clone())
                start += size
        else:
            received = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
            for tensor in received:
                dist.broadcast(tensor, group_src=0, group=group)
        if self.fail_next_update:
            message, self.fail_next_update = self.fail_next_update, ""
            raise RuntimeError(message)
        self.weights.update(zip(payload["names"], received, strict=True))
        if payload.get("weight_version") is not None:
            self.weight_version = payload["weight_version"]
        return "Succeeded to update parameter online."

    def leave_group(self, payload: dict) -> str:
        import torch.distributed as dist

        dist.destroy_process_group(self.groups.pop(payload["group_name"]))
        return "Succeeded to destroy custom process group."


def main(port_file: str) -> None:
    """Serves a fake until killed; writes its URL to port_file once it listens and torch is loaded (a
    first import inside /init_weights_update_group could outlast the group's timeout on a busy machine)."""
    import torch.distributed  # noqa: F401

    server = FakeSGLangServer()
    Path(port_file).write_text(server.url)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1])
