"""The .proto contract: buf STANDARD lint clean, committed stubs up to date, fields documented."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

from rlfabric.tools.protogen import PROTO_ROOT, REPO_ROOT, generate


def test_committed_stubs_match_the_protos(tmp_path):
    generate(tmp_path)
    committed = REPO_ROOT / "services" / "v1"
    stale = [
        p.name for p in sorted(tmp_path.iterdir())
        if not (committed / p.name).exists() or (committed / p.name).read_bytes() != p.read_bytes()
    ]
    assert stale == [], f"stubs are stale, run `make protos`: {stale}"


def test_buf_lint_standard_is_clean():
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    result = subprocess.run([buf, "lint"], cwd=PROTO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_message_field_and_rpc_has_a_comment():
    from google.protobuf import descriptor_pb2

    missing = []
    for path in sorted((PROTO_ROOT / "rlfabric" / "v1").glob("*.proto")):
        module = importlib.import_module(f"rlfabric.v1.{path.stem}_pb2")
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        text = (PROTO_ROOT / proto.name).read_text().splitlines()
        for number, line in enumerate(text):
            stripped = line.strip()
            declares = stripped.startswith(("message ", "rpc ", "service ", "enum ")) or (
                stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "package", "option"))
            )
            if declares and not text[number - 1].strip().startswith("//"):
                missing.append(f"{proto.name}:{number + 1}: {stripped}")
    assert missing == []


def test_no_service_proto_imports_another_services_proto():
    """The protos follow the floors: what two services share lives in common.proto (or tensor.proto,
    weight_sync.proto), so a service's .proto never imports another service's."""
    protos = {path.relative_to(PROTO_ROOT).as_posix(): path.read_text()
              for path in (PROTO_ROOT / "rlfabric" / "v1").glob("*.proto")}
    services = {name for name, text in protos.items() if re.search(r"^service ", text, re.M)}
    imports = {name: set(re.findall(r'^import "([^"]+)";', text, re.M)) for name, text in protos.items()}
    assert {name: sorted(imported & services) for name, imported in imports.items() if imported & services} == {}
    assert {"rlfabric/v1/common.proto", "rlfabric/v1/tensor.proto"} <= set(protos) and len(services) == 8


def test_request_and_response_messages_are_named_after_service_and_rpc():
    """<Service><Rpc>Request and <Service><Rpc>Response, in every service (protos/README.md)."""
    misnamed = []
    for path in sorted((PROTO_ROOT / "rlfabric" / "v1").glob("*.proto")):
        module = importlib.import_module(f"rlfabric.v1.{path.stem}_pb2")
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                expected = (f"{service.name}{method.name}Request", f"{service.name}{method.name}Response")
                if (method.input_type.name, method.output_type.name) != expected:
                    misnamed.append(f"{service.name}.{method.name}: {method.input_type.name}, {method.output_type.name}")
    assert misnamed == []


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout


def test_buf_breaking_against_the_previous_committed_protos():
    """Every proto change is wire- and source-compatible with the version committed before it."""
    commits = _git("log", "--format=%H", "--", "protos").split()
    changed_now = bool(_git("status", "--porcelain", "--", "protos").strip())
    # Compare the working tree with the last committed protos when they are being edited,
    # else the last committed protos with the ones before them.
    baseline = commits[0] if changed_now else (commits[1] if len(commits) > 1 else None)
    assert commits, "protos/ has no commit yet"
    if baseline is None:
        return  # the very first version of the protos has nothing to break
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    against = f"{REPO_ROOT}/.git#ref={baseline},subdir=protos"
    result = subprocess.run([buf, "breaking", "--against", against], cwd=PROTO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
