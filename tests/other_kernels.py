"""Run pytest once per CPU kernel capability other than this machine's own.

torch picks its CPU kernels (``default``, ``avx2``, ``avx512``) by what the CPU offers, or by
``ATEN_CPU_CAPABILITY``; each rounds float sums and bf16 matmuls its own way. A test that
compares two layouts of one run must hold under every one of them (not only under the one
the CI machine happens to pick), so tox reruns those tests (``-m layouts``) here under the
others. Where the CPU lacks a capability torch falls back to the best it has; the run then
says which kernels it got.

    python tests/other_kernels.py -- -m layouts
"""

from __future__ import annotations

import os
import subprocess
import sys

CAPABILITIES = ("default", "avx2", "avx512")


def _effective(env: dict[str, str]) -> str:
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return out.stdout.strip().lower() or "unknown"


def main(argv: list[str]) -> int:
    args = argv[argv.index("--") + 1 :] if "--" in argv else argv
    base = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    native = _effective(base)
    ran = {native}
    for cap in CAPABILITIES:
        env = {**base, "ATEN_CPU_CAPABILITY": cap}
        got = _effective(env)
        if got in ran:
            print(f"ATEN_CPU_CAPABILITY={cap}: torch runs {got} kernels, tested", flush=True)
            continue
        ran.add(got)
        print(f"ATEN_CPU_CAPABILITY={cap} (torch: {got}; this CPU's own: {native})", flush=True)
        rc = subprocess.call([sys.executable, "-m", "pytest", *args], env=env)
        if rc:
            return rc
    if ran == {native}:
        print(f"only {native} kernels exist on this CPU: nothing else to run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
