"""Sampling speed of the demo's policy: megatron's KV cache against re-running the forward.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.policy_bench``. One process, one
thread; the bf16 rollout engine of :mod:`ess_patch.demo.policy` samples ``T`` tokens for
``B`` prompts of the "sort" task (a) with megatron's ``StaticInferenceContext`` (what the demo
uses) and (b) by re-running the whole forward over prompt + tokens so far for every new token.
Also: the fp32 train forward over the same batch and the lag-0 bf16-vs-fp32 mismatch.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from ess_patch.demo import task
from ess_patch.demo.policy import (
    PolicySpec,
    RolloutEngine,
    build_policy,
    single_process,
    train_logprobs,
)


@torch.no_grad()
def _sample_no_cache(engine: RolloutEngine, prompts: torch.Tensor, n: int, gen: torch.Generator):
    ids = prompts
    for _ in range(n):
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        logits = engine.model(ids, pos, None, runtime_gather_output=True)
        lp = torch.log_softmax(logits[:, -1].float(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(lp.exp(), 1, generator=gen)], dim=1)
    return ids[:, prompts.shape[1] :]


def _train(model, prompts: torch.Tensor, tokens: torch.Tensor) -> None:
    train_logprobs(model, prompts, tokens).sum().backward()


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lengths", default="16,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"B={args.batch} prompts, 2-layer GPTModel hidden 64, one thread; best of {args.repeats}")
    print("T    kv-cache ms  ms/token  no-cache ms  train fwd+bwd ms  mismatch nats/token")
    for n in (int(x) for x in args.lengths.split(",")):
        spec = PolicySpec(max_len=2 * n + 2)
        with single_process():
            torch.manual_seed(0)
            model = build_policy(spec)
            engine = RolloutEngine(spec)
            engine.load(model.state_dict())
            gen = torch.Generator().manual_seed(0)
            prompts = task.make_prompts("sort", n, args.batch, gen)
            cached = _best(partial(engine.sample, prompts, n, gen), args.repeats)
            plain = _best(partial(_sample_no_cache, engine, prompts, n, gen), args.repeats)
            out = engine.sample(prompts, n, gen)
            fwd = _best(partial(_train, model, prompts, out.tokens), args.repeats)
            logp = train_logprobs(model, prompts, out.tokens).detach()
            mismatch = (logp - out.logp).abs().mean().item()
        print(
            f"{n:<4} {cached * 1e3:<12.1f} {cached * 1e3 / n:<9.2f} {plain * 1e3:<12.1f} "
            f"{fwd * 1e3:<17.1f} {mismatch:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
