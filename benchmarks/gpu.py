"""GPU readiness benchmark: ``python -m benchmarks.gpu [--out FILE] [--device cuda]``.

On a machine with one CUDA GPU: ``compute_ess_lr`` at 1 M / 8 M / 33 M tokens with fp32
and bf16 log-probs (wall time with CUDA events, kernel launches counted by
``torch.profiler``, host synchronisations counted by ``torch.cuda.set_sync_debug_mode``),
and the summary all-gather on a 1-rank NCCL group. Prints one table and writes it to
``--out`` (default ``gpu_bench.md``). Without a GPU it prints one line and exits 0.

Never run on a GPU so far (no device was available while it was written); the table and
the counting run on CPU in tests/test_gpu_bench.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

from ess_patch import compute_ess_lr

from .common import table

TOKENS = (1 << 20, 8 << 20, 33 << 20)
DTYPES = (torch.float32, torch.bfloat16)
SKIP_MESSAGE = "benchmarks.gpu: skipped, no CUDA GPU available (torch.cuda.is_available() is False)"


def make_batch(tokens: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Trajectories of 100-2000 tokens summing to ``tokens``, built on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(100, 2001, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - tokens
    lengths = [n for n in lengths if n > 0]
    rollout = torch.rand(tokens, generator=gen).mul_(-3.0)
    train = torch.randn(tokens, generator=gen).mul_(0.05).add_(rollout)
    mask = (torch.rand(tokens, generator=gen) > 0.1).to(torch.int32)
    cols = [
        x.to(device=device, dtype=d) for x, d in ((train, dtype), (rollout, dtype), (mask, None))
    ]
    return tuple(list(c.split(lengths)) for c in cols)


def count_kernels(fn, device: str) -> int:
    """Kernels launched (CUDA) or aten ops run (CPU) by one call, via ``torch.profiler``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    events = prof.events()
    if device == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)


def count_syncs(fn, device: str) -> int | str:
    """Host synchronisations of one call (CUDA's sync debug mode warns on each)."""
    if device != "cuda":
        return "n/a"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def time_ms(fn, device: str, repeats: int) -> float:
    """Best-of-``repeats`` wall time of one call, in milliseconds."""
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def estimator_rows(device: str, tokens=TOKENS, dtypes=DTYPES, repeats: int = 5) -> list[list]:
    rows = []
    for n in tokens:
        for dtype in dtypes:
            batch = make_batch(n, dtype, device)

            def call(b=batch):
                return compute_ess_lr(*b)

            call()  # warm-up (allocator, lazy init)
            rows.append(
                [
                    f"{n / 1e6:.3g}M",
                    str(dtype).removeprefix("torch."),
                    len(batch[0]),
                    f"{time_ms(call, device, repeats):.3g}",
                    count_kernels(call, device),
                    count_syncs(call, device),
                ]
            )
            del batch
    return rows


def nccl_row(device: str) -> list:
    """The DP summary all-gather on a 1-rank NCCL group (the only collective a 1-GPU run can
    exercise; with one rank ess_patch skips it, so this times the collective itself)."""
    if device != "cuda" or not torch.distributed.is_nccl_available():
        return ["all_gather (nccl, 1 rank)", "n/a", "n/a", "n/a"]
    import torch.distributed as dist

    from ess_patch.reduction import all_gather_summaries

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        summary = torch.zeros(10, dtype=torch.float64, device=device)

        def call():
            return all_gather_summaries(summary, dist.group.WORLD)

        call()
        return [
            "all_gather (nccl, 1 rank)",
            f"{time_ms(call, device, 20):.3g}",
            count_kernels(call, device),
            count_syncs(call, device),
        ]
    finally:
        dist.destroy_process_group()


def render(est_rows: list[list], coll_rows: list[list], device_name: str) -> str:
    text = table(
        ["tokens", "dtype", "B", "best ms", "kernels", "host syncs"],
        est_rows,
        title=f"## GPU: compute_ess_lr on {device_name}",
    )
    text += "\n\n" + table(["collective", "best ms", "kernels", "host syncs"], coll_rows)
    text += (
        "\n\nkernels: CUDA kernels launched per call (torch.profiler); host syncs: "
        "torch.cuda.set_sync_debug_mode warnings per call (the final .tolist() is one)\n"
        "not measured here: the wrapped optimizer.step() on a megatron-core "
        "DistributedOptimizer with bf16 params (see BENCHMARKS.md)\n"
    )
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("--out", default="gpu_bench.md", help="file the table is written to")
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the code path"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(SKIP_MESSAGE)
        return 0
    tokens = (1 << 14, 1 << 16) if args.quick else TOKENS
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    text = render(estimator_rows(args.device, tokens), [nccl_row(args.device)], name)
    print(text)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
