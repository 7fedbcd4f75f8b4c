"""verl (verl-project/verl, v0.6.0 to main @1dda039b9; PyPI 0.9.1): ESS-LR for the Megatron actor.

What ess-patch does to verl: every target of ``VERL`` (below) and its effect, per release.
Nothing else is touched; the LR itself is scaled at the actor's megatron-core
``optimizer.step()``, which each actor hook attaches for its call (``attach.py``).

| target (under ``verl.``) | v0.6.0 | v0.7.0, @b178a3cd5 | v0.8.0, 0.9.x, main |
|---|---|---|---|
| ``workers.engine_workers``: ``ActorRolloutRefWorker`` | absent | engine path | the path |
| ``.update_actor``; ``TrainingWorker.train_batch`` | | | |
| ``workers.actor.megatron_actor``: ``MegatronPPOActor`` | the path | legacy (default) | absent |
| ``.make_minibatch_iterator``, ``.update_policy`` | | | |
| ``workers.actor.dp_actor``: ``DataParallelPPOActor.update_policy`` | refused | refused | absent |
| ``utils.config.omega_conf_to_dataclass`` (+ by-name imports) | VCPO keys | VCPO keys | VCPO keys |
| ``trainer.constants_ppo.get_ppo_ray_runtime_env`` (+ main_ppo) | driver | driver | driver |
| ``workers.engine_workers_tinker``: ``TinkerActorRolloutRefWorker`` | absent | absent | refused |
| ``.forward_backward``, ``.optimizer_step`` | | | |

v0.6.0 trains the Megatron actor through the legacy actor only (its ``workers/roles`` serve
the FSDP strategy). The engine path is ``trainer.use_legacy_worker_impl=disable`` in v0.7.x;
verl PR #6067 (2026-04-20) removed the legacy workers, so from v0.8.0 it is the only actor
path.

- ``ActorRolloutRefWorker.update_actor``: on the actor's worker, marks the actor's
  ``TrainingWorker`` for the call (the critic's is another instance and is never touched),
  refuses a non-Megatron actor (``actor.strategy``) while ESS-LR is on, attaches the engine's
  optimizer, and with granularity "rollout" computes the ESS of the whole batch it got;
  disarms on the way out.
- ``TrainingWorker.train_batch``: on the marked ``TrainingWorker`` only, computes this
  mini-batch's ESS (granularity "step", VCPO's), arms it for the engine's one
  ``optimizer_step()`` inside, and adds ``lr_scale``, ``rho_ess``... to the step's metrics
  (the driver logs them as ``actor/lr_scale``...). Shadow mode: computed and logged as
  ``ess_lr_shadow_scale``, never armed.
- ``MegatronPPOActor.make_minibatch_iterator`` / ``MegatronPPOActor.update_policy`` (legacy):
  the same per mini-batch (or per rollout) ESS, armed for each ``actor_optimizer.step()`` as
  ``update_policy`` draws the mini-batches, metrics as ``actor/...`` lists.
- VCPO's baseline (``ESS_LR_BASELINE*`` or VCPO's ``actor.grad_baselining``, with or without
  ESS-LR; ``verl/baseline_config.py``): the chunk's GRPO advantages rewritten to ``A - b*``
  before any mini-batch is drawn (``verl/baseline.py``: the norm pass on the actor's model
  chunks, groups from ``uid`` reduced over DP), every mini-batch read back before verl trains
  on it, ``actor/ess_baseline_*`` logged. Legacy actor: ``make_minibatch_iterator`` rewrites,
  ``update_policy`` reads back. Engine path: ``update_actor`` rewrites the driver's
  TensorDict for the call, each ``train_batch`` reads its mini-batch back
  (``verl/engine_baseline.py``). The FSDP actor and the Tinker worker refuse it by name.
- ``TinkerActorRolloutRefWorker.forward_backward`` /
  ``TinkerActorRolloutRefWorker.optimizer_step`` (main's Tinker worker): refused while ESS-LR is
  on (they step the actor outside ``update_actor`` / ``train_batch``), before any gradient.
- ``get_ppo_ray_runtime_env`` (the driver, before ``ray.init``): every Ray actor's environment
  gets the auto-install and the driver's ``ESS_LR_*`` (``verl/driver.py``), so a driver that
  runs ess-patch never starts workers that train unscaled.
- ``omega_conf_to_dataclass``: VCPO's ``actor.ess_scaling`` node taken out before verl checks
  the actor config against its dataclass (unknown keys fail there), kept on the dataclass.

What the engine path hands ``train_batch`` (read in each snapshot's ``ray_trainer.py``,
``workers/utils/padding.py``, ``engine_workers.py``, ``workers/engine/megatron/``): the driver
turns the batch into a TensorDict and ``left_right_2_no_padding`` makes ``input_ids`` /
``position_ids`` / ``loss_mask`` nested (jagged); ``old_log_probs``, ``rollout_log_probs``
(with ``rollout.calculate_log_probs``) and ``response_mask`` stay padded ``[batch,
response_length]`` in every release (verl's own loss still calls ``to_padded_tensor`` on
them: a nested one is read per row too). ``update_actor`` gets this DP rank's chunk (dispatch
by DP; TP and CP ranks of a DP rank hold the same rows, CP splits sequences only inside the
model, every PP stage holds the batch); ``train_mini_batch`` draws
``tu.make_iterator(mini_batch_size / dp, epochs, seed + dp_rank, shuffle)`` and calls
``train_batch`` once per mini-batch: one ``optimizer_step()`` each, the LR scheduler after the
last. ``use_dynamic_bsz`` regroups micro-batches inside ``train_batch`` only (the step's
batch is the same). Metrics come back only from ``is_mp_src_rank_with_outputs()`` ranks (TP 0,
last PP stage, CP 0). So the ESS is one reduction over DP without CP, computed on the last
stage and broadcast over PP so that a fault there reaches every stage. main's
``dynamic_context_parallel`` replicates the mini-batch over DP x CP: rho and the scale are
unchanged by a uniform replication. With ``algorithm.rollout_correction.bypass_mode`` the
driver sets ``old_log_probs`` to the rollout log-probs (every release): refused, the ratio is
1. Without ``rollout_log_probs``: refused. Both on every rank, before any step.

The shapes, by feature (never by version string), each actor path on its own: the "path"
aspect, decided when ``verl.workers`` is imported, takes the legacy actor wherever its module
exists and the engine path wherever its module exists (both in v0.7.x, the legacy actor alone
in v0.6.x, the engine path alone from v0.8.0; a release in between is read the same way).
With neither, verl is rolled back at that import with one logged error line naming the
supported releases (``failed_integrations()``; ``doctor`` reports it as a problem); with
``ESS_LR_ENABLE`` on in that process, the import itself fails with that error
(:class:`~ess_patch.patching.FailClosedError`): the run stops instead of training unscaled
(VCPO's ``actor.ess_scaling`` then fails verl's own check of the actor config).
The "engine" and "actor" aspects check the hooked methods' parameters when their modules are
imported, so a verl that renamed them is refused by name instead of silently unscaled.

Settings, per update (``verl.config.settings``): on with ``ESS_LR_ENABLE=1`` or
``actor.ess_scaling.enable``; the rest from ``ESS_LR_*`` (``EssLrConfig.from_env`` via
``install()``), VCPO's keys winning for the fields they name.

The files: ``targets.py`` (``VERL``: the table above), ``shapes.py`` (``VERL_HISTORY``, the
modules and the supported releases), ``engine.py`` (the engine path and the Tinker worker),
``legacy_actor.py`` (the legacy Megatron actor and the FSDP actor's refusal), ``batch.py``
(the ESS of one batch, both paths'), ``adapters.py`` (a bound argument, the optimizer
attached for one update, the strategy refusal), ``driver.py``, ``config.py`` and
``baseline_config.py`` (settings), ``baseline.py`` (VCPO's baseline) and
``engine_baseline.py`` (it on the engine path's TensorDict). Every public name is
re-exported here.
"""

from __future__ import annotations

from .batch import compute_batch
from .config import VerlSettings, config_wrapper, settings
from .driver import runtime_env_wrapper
from .engine import engine_train_batch_wrapper, engine_update_actor_wrapper, tinker_wrapper
from .legacy_actor import (
    METRIC_PREFIX,
    fsdp_update_policy_wrapper,
    minibatch_iterator_wrapper,
    update_policy_wrapper,
)
from .shapes import NAME, SNAPSHOT, SUPPORTED, VERL_HISTORY
from .targets import VERL

__all__ = [
    "METRIC_PREFIX",
    "NAME",
    "SNAPSHOT",
    "SUPPORTED",
    "VERL",
    "VERL_HISTORY",
    "VerlSettings",
    "compute_batch",
    "config_wrapper",
    "engine_train_batch_wrapper",
    "engine_update_actor_wrapper",
    "fsdp_update_policy_wrapper",
    "minibatch_iterator_wrapper",
    "runtime_env_wrapper",
    "settings",
    "tinker_wrapper",
    "update_policy_wrapper",
]
