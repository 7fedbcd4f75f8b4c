"""Demo-only: run megatron-core's optimizer and DDP on a CPU-only torch build.

This is *not* part of the ess-patch runtime and is never entered by ``install()``: the demo
uses it so that ``ess-patch demo`` can drive megatron-core's real classes
(``get_megatron_optimizer``, ``DistributedDataParallel``, ``OptimizerParamScheduler``) on a
laptop. Production runs are on GPUs and need nothing of this.

megatron-core (0.14-0.19) hard-codes CUDA in a few places the demo (and the project's
tests, which use this same shim) reach; each piece below was checked to be necessary:

* A ``TorchFunctionMode`` maps ``device='cuda'`` / ``'cuda:N'`` / ``torch.device('cuda')`` /
  an int ordinal to the CPU in every torch call: ``FP32Optimizer.__init__`` (``_scale``),
  ``MixedPrecisionOptimizer.__init__`` (``found_inf``, ``_scale_one``), the grad scalers,
  ``clip_grads.get_grad_norm_fp32`` / ``count_zeros_fp32`` (every ``ChainedOptimizer.step``)
  and ``_ParamAndGradBuffer.__init__`` (DDP grad buffers). ``Tensor.cuda()`` /
  ``.to('cuda')`` become no-ops (grad-scaler and distributed-optimizer checkpoint paths).
* Inside the mode, CPU tensors report their CUDA type name from ``Tensor.type()``:
  ``Float16OptimizerWithFloat16Params.__init__`` and
  ``DistributedOptimizer._build_model_and_main_param_groups`` reject other types, and
  ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` (clip_grad > 0).
* ``torch.cuda.current_device()`` raises on a CPU build: stubbed to return 0 (DDP grad
  buffers are allocated on it).
* ``torch.cuda.current_stream()`` (0.19: ``start_grad_sync`` waits there for CUDA-graph
  events, which CPU parameters never carry): stubbed with a stream that has nothing to wait for.
* The model-parallel RNG tracker: megatron's local ``DotProductAttention`` forks the CUDA RNG
  state around its attention dropout on every forward (``get_cuda_rng_tracker().fork()``),
  and a CPU build has no CUDA RNG. The demo's GPTModel has no dropout (0.0), so ``fork`` is
  made a no-op while the shim is entered.

Not needed on these paths: ``torch.cuda.Stream`` (only with several distributed-optimizer
instances or overlapped grad reduce), ``torch.cuda.synchronize``, ``is_available``.

Everything is restored when the context exits. The mode is per thread: enter it in every
rank process, around the megatron calls (construction and ``optimizer.step()``). The demo
runs on the CPU even where a GPU exists (gloo, CPU tensors), so the shim is always entered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["megatron_on_cpu"]

_CUDA_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        # Tensor.to and the parser behind TensorDict.to take the device positionally
        if func is torch.Tensor.to or func is torch._C._nn._parse_to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPES.get(name, name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Let megatron-core's CUDA-assuming optimizer / DDP code run on the CPU (demo only)."""
    from megatron.core.tensor_parallel import random as tp_random

    saved = torch.cuda.current_device, torch.cuda.current_stream
    tp_random.initialize_rng_tracker()
    tracker = tp_random.get_cuda_rng_tracker()
    saved_fork = tracker.__dict__.get("fork")
    torch.cuda.current_device = lambda: 0
    torch.cuda.current_stream = lambda *_a, **_k: _NoStream()
    tracker.fork = _no_fork
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.current_stream = saved
        if saved_fork is None:
            del tracker.fork
        else:
            tracker.fork = saved_fork


@contextlib.contextmanager
def _no_fork(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    """The RNG tracker's ``fork`` on the CPU: nothing random runs inside (no dropout)."""
    yield


class _NoStream:
    """The current "stream" on the CPU: everything already happened in order."""

    def wait_event(self, _event: Any) -> None:
        return None
