"""Run one fixed training sequence on every Megatron optimizer kind; dump the results as bytes.

    python tests/patches_twin.py --mode monkeypatch|vendored --out FILE

``monkeypatch``: the installed megatron-core with ``ess_patch.install("megatron")``.
``plain``: the installed megatron-core, nothing installed (the control: under the opt-out
``ESS_PATCH_ALLOW_UNSCALED=1`` arming does nothing; without it the first armed step stops).
``vendored``: a megatron-core copy patched with ``patches/`` first on PYTHONPATH, no
``install()``; every target must carry the diff's call site. tests/test_patches.py runs both
in fresh processes and compares the two files byte for byte.

The sequence per kind: one disarmed step, two steps armed at 0.37, one at 0.8 (new rollout),
one disarmed again; then, for a bf16 optimizer with a loss scaler, an armed step with NaN
gradients (skipped by megatron) followed by an armed good one. Every tensor of the final
snapshot (model params, main params, optimizer state), every LR and grad norm is written.
"""

from __future__ import annotations

import argparse
import struct
import sys
import tempfile
from pathlib import Path

import torch
from megatron_cpu import (
    KINDS,
    build_megatron_optimizer,
    megatron_world,
    snapshot,
    train_steps,
)

import ess_patch
from ess_patch.demo.cpu import megatron_on_cpu
from ess_patch.install import INTEGRATIONS
from ess_patch.patching import MISSING, VENDORED, target_status


def _check_mode(mode: str) -> None:
    import importlib

    marks = []
    for target in INTEGRATIONS["megatron"].targets:
        importlib.import_module(target.module)
        status = target_status(target)
        if status != MISSING and target.vendored:  # install()-only targets: no series
            marks.append(status == VENDORED)
    if mode == "vendored":
        assert marks and all(marks), "megatron on PYTHONPATH is not the patched copy"
        assert not ess_patch.is_installed()
    else:
        assert not any(marks), "the installed megatron-core is patched; expected a pristine one"
    if mode == "monkeypatch":
        ess_patch.install("megatron")
        series = {t.path for t in INTEGRATIONS["megatron"].targets if t.vendored}
        assert len([p for p in ess_patch.installed_targets() if p in series]) == len(marks)


def _walk(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().cpu()
        out.append(f"{t.dtype}{tuple(t.shape)}".encode())
        out.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            out.append(str(key).encode())
            _walk(obj[key], out)
    elif isinstance(obj, (list, tuple)):
        out.append(f"[{len(obj)}".encode())
        for item in obj:
            _walk(item, out)
    elif isinstance(obj, float):
        out.append(struct.pack("<d", obj))
    else:
        out.append(repr(obj).encode())


def _sequence(setup) -> list:
    records = train_steps(setup, 1, data_seed=0)
    ess_patch.arm(0.37)
    records += train_steps(setup, 2, data_seed=1)
    ess_patch.arm(0.8)
    records += train_steps(setup, 1, data_seed=2)
    ess_patch.disarm()
    records += train_steps(setup, 1, data_seed=3)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("monkeypatch", "vendored", "plain"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    chunks: list[bytes] = []
    with tempfile.TemporaryDirectory() as tmp, megatron_on_cpu(), megatron_world(tmp):
        _check_mode(args.mode)
        cases = [(kind, "adam", {}) for kind in KINDS]
        cases += [(kind, "sgd", {}) for kind in KINDS if "dist" not in kind]
        for kind, optimizer, extra in cases:
            setup = build_megatron_optimizer(kind, optimizer=optimizer, clip_grad=1.0, **extra)
            records = _sequence(setup)
            chunks.append(f"== {kind} {optimizer}".encode())
            _walk([tuple(r) for r in records], chunks)
            _walk(snapshot(setup), chunks)
        setup = build_megatron_optimizer("bf16", optimizer="adam", loss_scale=1.0)
        ess_patch.arm(0.5)
        records = train_steps(setup, 2, poison_steps=(0,))
        ess_patch.disarm()
        assert records[0].update_successful is False
        chunks.append(b"== bf16 skipped")
        _walk([tuple(r) for r in records], chunks)
        _walk(snapshot(setup), chunks)
    args.out.write_bytes(b"\n".join(chunks))
    print(f"{args.mode}: {len(cases) + 1} runs, {args.out.stat().st_size} bytes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
