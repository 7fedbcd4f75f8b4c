"""The demo's trainer: one rank's fully-async RL of a megatron-core GPTModel, ESS-LR per arm.

Every rank runs :func:`~ess_patch.demo.trainer.loop.run_rank` after the launcher has set up
the process group and megatron's ``parallel_state`` (DP x TP x PP). For each arm it builds the
policy (:mod:`ess_patch.demo.policy`: a tiny ``GPTModel``, same seed in every arm) for this rank's
pipeline stage and tensor-parallel shard, wraps it in megatron's
``DistributedDataParallel``, builds the optimizer with ``get_megatron_optimizer`` (Adam,
fp32, grad clipping) and ``OptimizerParamScheduler``, and trains. ``ess_patch.install()``
patches the optimizer classes once per process; the "off" arm shows it changes nothing
until a result is armed.

Per step (= one rollout, one optimizer step):

1. Rollout (each DP rank its own prompts; its TP and PP peers sample the same tokens): the
   rank's ``rollout_workers`` each sample their share of the prompts with the bf16
   :class:`~ess_patch.demo.policy.RolloutEngine` loaded with the weights they last pulled.
   Worker ``w`` pulls the newest weights every ``1 + round(w * max_lag / (workers - 1))``
   steps, so worker 0 is always fresh and the slowest one runs up to ``max_lag`` updates
   behind: most rollouts are a little stale, a tail is very stale, as in a fully-async
   system with a staleness bound. The log-probs are recorded at sampling time, in bf16.
2. Forward and backward through megatron's own schedule (``get_forward_backward_func``:
   no pipelining, or 1F1B over the pipeline stages), the loss a framework ships:
   ``"tis"``: token-level truncated IS (miles/slime's TIS: each token's policy gradient
   weighted by ``min(exp(logp_t - rollout_logp_t), tis_clip)``), or ``"sequence"``:
   sequence-level IS without truncation (every token weighted by
   ``exp(sum_t(logp_t - rollout_logp_t))``, VCPO's regime). Group-relative advantages.
3. Every rank: ``compute_ess_lr`` over the step's trajectories with the DP and PP groups
   (the last stage has the log-probs; every stage gets the result); ``ess_patch.arm``.
4. ``optimizer.step()`` (the patched step applies the armed scale), ``scheduler.step()``.
5. The new weights go to the rollout workers (the PP stages all-gather their slices).

The applied LR is read inside the step, by a pre-step hook on megatron's inner torch
optimizer; the scheduled LR is ``param_groups``' LR outside the step.

Context parallelism: megatron's local attention (``DotProductAttention``) refuses CP (only
Transformer Engine's attention has it), so the demo runs CP = 1; the CP reductions of
``compute_ess_lr`` are tested in ``tests/test_reduction_dist.py``.

The modules, each importing only those before it: :mod:`.config` (``DemoConfig``, its
validation, the arms), :mod:`.model` (this rank's layout, the model stage in megatron's DDP
with its optimizer and scheduler, the weights published to the rollout workers),
:mod:`.sampling` (the workers' staleness and a step's rollout), :mod:`.loss` (the
policy-gradient loss, the micro-batches and megatron's forward/backward over them),
:mod:`.record` (a step's record fields) and :mod:`.loop` (``run_rank`` and an arm's loop).
:mod:`ess_patch.demo.train` is the old name, an alias of them all.
"""
