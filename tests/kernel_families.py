"""`make test-kernels`: the numerics tests (marker `numerics`, bounds in tests/numerics.py) under each CPU kernel
family torch has on this machine other than its own, which `make test` runs. torch picks its kernels once per
process from ATEN_CPU_CAPABILITY (default = no SIMD, avx2, avx512; the best the CPU has when unset), and the
families sum in other orders: a bound that holds on one family only fails here. CI runs it after `make test`.
The vLLM tests (marker `vllm`) run under the machine's own family only (`make test`): vLLM's CPU kernels are its
own, compiled for the host, not ATen's, and the ones it compiles at run time with torch.compile (inductor) come out
wrong under a family forced below the host's: on an AVX-512 machine under ATEN_CPU_CAPABILITY=avx2, torch 2.13's
inductor computes a compiled `x - c` on int64 wrongly for half the elements, and vLLM's tensor-parallel embedding
indexes out of range; under "default" the generated C++ does not compile. Forcing the family tests ATen's kernels,
which the trainer and the hf engine run on.

    python -m tests.kernel_families [pytest arguments...]
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

# x86-64 families from the least to the most capable; elsewhere torch has "default" and its native one only.
X86_FAMILIES = ["default", "avx2", "avx512"]


def capability(family: str | None) -> str:
    """The kernel family a fresh torch process uses with ATEN_CPU_CAPABILITY=family (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if family is not None:
        env["ATEN_CPU_CAPABILITY"] = family
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True,
                          text=True).stdout.strip().lower()


def other_families(native: str) -> list[str]:
    """The families this CPU can run, less `native`, the one `make test` ran (torch's own choice)."""
    candidates = X86_FAMILIES if platform.machine() in ("x86_64", "AMD64") else ["default"]
    if native not in candidates:
        return [family for family in candidates if family != native]
    return candidates[: candidates.index(native)]


def main(pytest_args: list[str]) -> int:
    native = capability(None)
    families = other_families(native)
    print(f"torch's own kernel family here: {native} (make test); also running: {', '.join(families)}")
    failed = []
    for family in families:
        used = capability(family)
        if used != family:  # torch ignored the request: the run would not test what it says
            print(f"ATEN_CPU_CAPABILITY={family}: torch used {used}", file=sys.stderr)
            return 2
        print(f"\n== ATEN_CPU_CAPABILITY={family} ==", flush=True)
        command = [sys.executable, "-m", "pytest", "-m", "numerics and not vllm", *pytest_args]
        if subprocess.run(command, env={**os.environ, "ATEN_CPU_CAPABILITY": family}).returncode != 0:
            failed.append(family)
    if failed:
        print(f"numerics tests failed under: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"numerics tests passed under: {', '.join(families)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
