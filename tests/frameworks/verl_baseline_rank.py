"""What one rank runs in the verl baseline tests (``test_verl_baseline.py``).

``refusal_probe``: every verl path that cannot apply VCPO's baseline, called through verl's
own (patched) method with the baseline asked for each way; what each call raised.
"""

from __future__ import annotations

import os
from typing import Any

from verl_rank import _import_verl, has_engine_path, has_legacy_actor

#: the ways to ask for the baseline: (environment, actor-config node)
REQUESTS = {
    "env_on": ({"ESS_LR_BASELINE": "1"}, {}),
    "env_shadow": ({"ESS_LR_BASELINE_SHADOW": "1"}, {}),
    "vcpo_key": ({}, {"grad_baselining": {"enable": True}}),
    "off": ({}, {}),
}


def refusal_probe(src: str) -> dict:
    """The engine path's ``update_actor``, the legacy FSDP actor's ``update_policy`` and main's
    Tinker worker, each with every request of :data:`REQUESTS` (ESS-LR itself off): the error
    each raised (off: verl's own error on a batch of None)."""
    from omegaconf import OmegaConf

    _import_verl(src)
    import ess_patch

    ess_patch.install("verl")
    out: dict[str, Any] = {}
    for request, (env, node) in REQUESTS.items():
        for key in ("ESS_LR_BASELINE", "ESS_LR_BASELINE_SHADOW", "ESS_LR_ENABLE"):
            os.environ.pop(key, None)
        os.environ.update(env)
        calls = []
        if has_engine_path():
            from verl.workers.engine_workers import ActorRolloutRefWorker

            worker = object.__new__(ActorRolloutRefWorker)
            config = OmegaConf.create({"actor": {"strategy": "megatron", **node}})
            vars(worker).update(actor=object(), config=config)
            calls.append(("engine", lambda w=worker: w.update_actor(None)))
        if has_legacy_actor():
            from verl.workers.actor.dp_actor import DataParallelPPOActor

            actor = object.__new__(DataParallelPPOActor)
            vars(actor).update(config=OmegaConf.create({"strategy": "fsdp", **node}))
            calls.append(("fsdp", lambda a=actor: a.update_policy(None)))
        try:
            from verl.workers.engine_workers_tinker import TinkerActorRolloutRefWorker
        except ImportError:
            TinkerActorRolloutRefWorker = None  # only verl main has it
        if TinkerActorRolloutRefWorker is not None:
            tinker = object.__new__(TinkerActorRolloutRefWorker)
            config = OmegaConf.create({"actor": {"strategy": "megatron", **node}})
            vars(tinker).update(config=config, role="rollout")
            calls.append(("tinker", lambda t=tinker: t.forward_backward(None)))
        for name, call in calls:
            try:
                call()
                out[f"{name}_{request}"] = "ok"
            except Exception as exc:
                out[f"{name}_{request}"] = f"{type(exc).__name__}: {exc}"
    return out
