"""One rank of the demo: fully-async RL of a megatron-core GPTModel, with ESS-LR per arm.

Every rank runs :func:`run_rank` after the launcher has set up the process group and
megatron's ``parallel_state`` (DP x TP x PP). For each arm it builds the policy
(:mod:`ess_patch.demo.policy`: a tiny ``GPTModel``, same seed in every arm) for this rank's
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
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from .. import EssLrConfig, arm, calibration, compute_ess_lr, disarm
from ..errors import EssPatchError, EssPatchValueError
from . import task as task_mod
from .policy import (
    PolicySpec,
    RolloutEngine,
    build_policy,
    global_weights,
    response_logprobs,
    train_inputs,
)
from .staleness import VARYING, step_lag
from .tape import TAPE_MODES, RolloutTape

__all__ = ["ARMS", "DemoConfig", "DemoConfigError", "rollout_lags", "run_rank", "worker_lags"]

logger = logging.getLogger(__name__)

#: "off": never armed; "on": ESS-LR with ``ess``; "geometric" / "product": ESS-LR with
#: that weight mode; "vcpo": VCPO's rule (product weights, sqrt, one scale per optimizer
#: step, no floor); "constant": armed every step with one fixed scale, ``constant_scale``
#: if set, else the mean scale of the ``control_of`` arm in the same run (a smaller LR that
#: does not look at staleness); "sync": the "off" arm with every rollout fresh (lag 0, the
#: synchronous reference); "calibrated": product weights with ``calibrate_rollouts``;
#: "baseline": never armed, VCPO's minimum-variance off-policy baseline in place of the group
#: mean (:mod:`ess_patch.demo.opob`); "ess+baseline": that baseline and the "product" arm's
#: ESS-LR (VCPO as published: both halves); "proxy" / "ess+proxy": the same baseline with the
#: forward-only proxy's norms (:mod:`ess_patch.proxy`, verl's Optimal Token Baseline) in the loss.
ARMS = (
    "off",
    "on",
    "geometric",
    "product",
    "vcpo",
    "constant",
    "sync",
    "calibrated",
    "baseline",
    "ess+baseline",
    "proxy",
    "ess+proxy",
)
#: The arms whose advantage is ``R - b*`` (VCPO's baseline) instead of the group mean's.
BASELINE_ARMS = ("baseline", "ess+baseline")
#: The arms whose ``b*`` comes from the forward-only proxy's norms, taken in the loss.
PROXY_ARMS = ("proxy", "ess+proxy")
DEFAULT_ARMS = ("off", "geometric", "product")
#: The policy-gradient losses (see the module docstring).
LOSSES = ("tis", "sequence", "seq-tis")
#: How stale the rollouts are: "mixed": workers pulling at different periods (up to ``lag``
#: behind, see :func:`worker_lags`); "fixed": every rollout exactly ``lag`` updates behind
#: (a fully-async trainer at steady state; the first ``lag`` steps use the initial weights).
STALENESS = ("mixed", "fixed", *VARYING)
#: "No floor" for the vcpo arm: EssLrConfig wants a floor > 0, and rho >= 1/B keeps the
#: sqrt rule's scale >= 1/sqrt(B * base_ratio), far above this: it never binds.
VCPO_FLOOR = 1e-9
#: Log-ratios are clamped to +-this before exp() only so that float32 stays finite; the
#: number of clamped values is recorded per step (``clamped``).
MAX_LOG_RATIO = 20.0
DEVICES = ("cpu", "cuda")
HEADS = 4
MIN_RESPONSE, MAX_RESPONSE = 1, 256


class DemoConfigError(EssPatchError, ValueError):
    """A :class:`DemoConfig` field is out of range; ``field`` names it (the CLI: a flag)."""

    def __init__(self, field: str, value: Any, problem: str) -> None:
        self.field, self.value, self.problem = field, value, problem
        super().__init__(f"DemoConfig.{field}={value!r}: {problem}")


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on (the same on every rank)."""

    steps: int = 150
    #: Maximum staleness of a rollout, in optimizer updates.
    lag: int = 8
    rollout_workers: int = 4
    seed: int = 0
    dp: int = 2
    tp: int = 1
    pp: int = 1
    cp: int = 1
    device: str = "cpu"
    task: str = "sort"
    response_len: int = 16
    num_layers: int = 2
    hidden: int = 64
    #: The ESS-LR settings (the "geometric" / "product" / "vcpo" arms override some).
    ess: EssLrConfig = field(default_factory=EssLrConfig)
    lr: float = 1e-3
    warmup: int = 10
    clip_grad: float = 1.0
    prompts_per_rank: int = 8
    group_size: int = 4
    microbatches: int = 1
    arms: tuple[str, ...] = DEFAULT_ARMS
    loss: str = "tis"
    tis_clip: float = 2.0
    control_of: str = "product"
    staleness: str = "mixed"
    #: seq-tis: VCPO's truncation threshold c of the sequence weight min(exp(sum), c).
    is_threshold: float = 8.0
    #: The policy's initial weights: a whole-model (TP = PP = 1) state dict saved by
    #: :mod:`ess_patch.demo.warm_start` (loaded with ``weights_only=True``); None: from the seed.
    init_weights: str | None = None
    #: The "constant" arm's scale; None: the mean scale of ``control_of`` in the same run.
    constant_scale: float | None = None
    #: The "calibrated" arm's ``calibrate_rollouts``.
    calibration_rollouts: int = 10
    #: False: ess-patch is never installed, nothing of it is called (the bit-identity check
    #: of the "off" arm against a run without ess-patch).
    install_ess: bool = True
    #: A directory of sampled tokens (:mod:`ess_patch.demo.tape`): ``tape_mode="record"``
    #: writes each step's, ``"replay"`` scores another run's teacher-forced instead of
    #: sampling (layouts compared on the same tokens); None: sample, record nothing.
    rollout_tape: str | None = None
    tape_mode: str = "record"

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", tuple(self.arms))
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms or len(set(self.arms)) != len(self.arms):
            raise DemoConfigError("arms", self.arms, f"give distinct arms among {ARMS}")
        # in this order: the first wrong setting is the one named
        self._check_sizes()
        self._check_shapes()
        self._check_training()

    def _check_sizes(self) -> None:
        """Counts, the layout and the device."""
        for name in (
            "steps",
            "dp",
            "tp",
            "pp",
            "cp",
            "prompts_per_rank",
            "group_size",
            "rollout_workers",
            "microbatches",
            "num_layers",
        ):
            if getattr(self, name) < 1:
                raise DemoConfigError(name, getattr(self, name), "must be >= 1")
        if self.lag < 0:
            raise DemoConfigError("lag", self.lag, "must be >= 0")
        if self.cp != 1:
            raise DemoConfigError(
                "cp",
                self.cp,
                "context parallelism needs Transformer Engine's attention (megatron's local "
                "attention refuses it), so the demo runs cp=1; ess-patch's CP reductions are "
                "tested in tests/test_reduction_dist.py",
            )
        if self.device not in DEVICES:
            raise DemoConfigError("device", self.device, f"give one of {DEVICES}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise DemoConfigError(
                "device",
                self.device,
                f"no CUDA device is available to this torch ({torch.__version__}); "
                "run on a GPU machine or use --device cpu",
            )
        if self.device == "cuda" and self.world_size > torch.cuda.device_count():
            raise DemoConfigError(
                "device",
                self.device,
                f"{self.world_size} ranks need {self.world_size} GPUs, "
                f"{torch.cuda.device_count()} visible",
            )

    def _check_shapes(self) -> None:
        """What the task, the model and the layout must divide."""
        if self.task not in task_mod.TASKS:
            raise DemoConfigError("task", self.task, f"give one of {task_mod.TASKS}")
        if not MIN_RESPONSE <= self.response_len <= MAX_RESPONSE:
            raise DemoConfigError(
                "response_len", self.response_len, f"must be in [{MIN_RESPONSE}, {MAX_RESPONSE}]"
            )
        if task_mod.VOCAB % self.tp:
            raise DemoConfigError("tp", self.tp, f"must divide the vocabulary ({task_mod.VOCAB})")
        if HEADS % self.tp:
            raise DemoConfigError("tp", self.tp, f"must divide the {HEADS} attention heads")
        if self.hidden < 1 or self.hidden % HEADS:
            raise DemoConfigError("hidden", self.hidden, f"must be a multiple of {HEADS} (heads)")
        if self.num_layers % self.pp:
            raise DemoConfigError(
                "pp", self.pp, f"must divide the number of layers ({self.num_layers})"
            )
        if self.rollouts_per_rank % self.microbatches:
            raise DemoConfigError(
                "microbatches",
                self.microbatches,
                f"must divide the rollouts per rank ({self.rollouts_per_rank})",
            )
        mb = self.rollouts_per_rank // self.microbatches
        if any(a in PROXY_ARMS for a in self.arms) and mb % self.group_size:
            raise DemoConfigError(
                "microbatches",
                self.microbatches,
                f"the proxy arms take b* in the loss: a micro-batch ({mb} rollouts) must hold "
                f"whole groups of {self.group_size}",
            )

    def _check_training(self) -> None:
        """The loss, the staleness, the arms' own settings, the tape and ESS-LR's config."""
        if self.loss not in LOSSES:
            raise DemoConfigError("loss", self.loss, f"give one of {LOSSES}")
        if self.staleness not in STALENESS:
            raise DemoConfigError("staleness", self.staleness, f"give one of {STALENESS}")
        if not self.is_threshold > 0:
            raise DemoConfigError("is_threshold", self.is_threshold, "must be > 0")
        if self.constant_scale is not None and not 0 < self.constant_scale <= 1:
            raise DemoConfigError("constant_scale", self.constant_scale, "must be in (0, 1]")
        if self.calibration_rollouts < 1:
            raise DemoConfigError("calibration_rollouts", self.calibration_rollouts, "must be >= 1")
        if not self.tis_clip > 0:
            raise DemoConfigError("tis_clip", self.tis_clip, "must be > 0")
        if self.control_of not in ("on", "geometric", "product", "vcpo"):
            raise DemoConfigError(
                "control_of", self.control_of, "give 'on', 'geometric', 'product' or 'vcpo'"
            )
        if (
            "constant" in self.arms
            and self.constant_scale is None
            and self.control_of not in self.arms[: self.arms.index("constant")]
        ):
            raise DemoConfigError(
                "arms",
                self.arms,
                f"the 'constant' arm copies the mean scale of control_of={self.control_of!r}, "
                "which must come before it",
            )
        if self.tape_mode not in TAPE_MODES:
            raise DemoConfigError("tape_mode", self.tape_mode, f"give one of {TAPE_MODES}")
        if self.tape_mode == "replay" and not self.rollout_tape:
            raise DemoConfigError(
                "rollout_tape", self.rollout_tape, "tape_mode='replay' needs the tape's directory"
            )
        if not isinstance(self.ess, EssLrConfig):
            raise DemoConfigError("ess", self.ess, "must be an ess_patch.EssLrConfig")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def rollouts_per_rank(self) -> int:
        return self.prompts_per_rank * self.group_size

    @property
    def spec(self) -> PolicySpec:
        n = self.response_len
        return PolicySpec(
            num_layers=self.num_layers,
            hidden=self.hidden,
            heads=HEADS,
            max_len=task_mod.prompt_length(self.task, n) + n,
        )

    def ess_config(self, arm_name: str | None = None) -> EssLrConfig:
        """The ESS-LR config of an arm (its own weight mode, VCPO's rule for "vcpo")."""
        if arm_name in ("geometric", "product"):
            return replace(self.ess, weight_mode=arm_name)
        if arm_name in ("ess+baseline", "ess+proxy"):
            return replace(self.ess, weight_mode="product")
        if arm_name == "calibrated":
            return replace(
                self.ess, weight_mode="product", calibrate_rollouts=self.calibration_rollouts
            )
        if arm_name == "vcpo":
            return replace(
                self.ess, weight_mode="product", rule="sqrt", floor=VCPO_FLOOR, granularity="step"
            )
        return self.ess

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rollout_lags(cfg: DemoConfig, step: int, lag: int) -> list[int]:
    """Each rollout worker's staleness at ``step`` under ``cfg.staleness`` (max ``lag``)."""
    if cfg.staleness == "fixed":
        return [min(step, lag)] * cfg.rollout_workers
    if cfg.staleness in VARYING:
        return [step_lag(cfg.staleness, step, lag, cfg.seed)] * cfg.rollout_workers
    return worker_lags(step, cfg.rollout_workers, lag)


def worker_lags(step: int, workers: int, max_lag: int) -> list[int]:
    """How many updates behind the trainer each rollout worker's weights are at ``step``.

    Worker ``w`` pulls the newest weights every ``1 + round(w * max_lag / (workers - 1))``
    steps (worker 0 every step; one worker: every ``max_lag + 1``), starting at step 0, with
    phase ``w`` so that the workers do not all pull at once; never more than ``step``.
    """
    out = []
    for w in range(workers):
        period = 1 + (round(w * max_lag / (workers - 1)) if workers > 1 else max_lag)
        out.append(min(step, (step + w) % period))
    return out


@dataclass
class _Layout:
    dp_rank: int
    tp_rank: int
    pp_rank: int
    dp_group: Any
    pp_group: Any
    layer_offset: int

    @classmethod
    def current(cls, config: Any) -> _Layout:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        return cls(
            dp_rank=ps.get_data_parallel_rank(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_group=ps.get_data_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            layer_offset=get_transformer_layer_offset(config),
        )


def is_writer(cfg: DemoConfig, lay: _Layout) -> bool:
    """The rank that records the steps: last pipeline stage, first DP and TP rank."""
    return lay.pp_rank == cfg.pp - 1 and lay.dp_rank == 0 and lay.tp_rank == 0


def run_rank(cfg: DemoConfig, progress: Any = None) -> list[dict[str, Any]] | None:
    """Train every arm on this rank; the writer rank returns the per-step records.

    ``progress``: an object with ``put((arm, step))`` (a multiprocessing queue), fed by the
    writer rank after every step.
    """
    installed = False
    if cfg.install_ess:
        import ess_patch

        ess_patch.install(["megatron"], config=cfg.ess_config())
        installed = True
    try:
        records: list[dict[str, Any]] = []
        mean_scale: dict[str, float] = {}
        writer = False
        for arm_name in cfg.arms:
            constant = mean_scale.get(cfg.control_of, 1.0)
            arm_records, scales, writer = _train_arm(cfg, arm_name, progress, constant)
            records += arm_records
            # every rank holds the same scales (compute_ess_lr's result is global)
            mean_scale[arm_name] = sum(scales) / len(scales)
    finally:
        if installed:
            import ess_patch

            disarm()
            ess_patch.uninstall()
    return records if writer else None


def _build(cfg: DemoConfig):
    """This rank's model stage in megatron's DDP, its optimizer and scheduler."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # The whole model first, from the seed, then this stage's slice of it: every pipeline
    # layout starts from the same weights as pp=1 (a stage alone would draw its layers from
    # another point of the RNG stream).
    whole = (
        build_policy(cfg.spec, tp=cfg.tp, pp=1, device=cfg.device)
        if cfg.pp > 1 and cfg.init_weights is None
        else None
    )
    model = build_policy(
        cfg.spec,
        tp=cfg.tp,
        pp=cfg.pp,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        device=cfg.device,
    )
    if whole is not None:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        source = whole.state_dict()
        local = model.state_dict()
        names = global_weights(model, get_transformer_layer_offset(model.config))
        # global_weights keeps the stage's order: local name i <-> whole-model name i
        model.load_state_dict(
            {mine: source[name] for mine, name in zip(local, names, strict=True)}, strict=True
        )
    del whole
    if cfg.init_weights is not None:
        _load_init(model, cfg)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        model,
    )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.lr,
        weight_decay=0.0,
        clip_grad=cfg.clip_grad,
        bf16=False,
        params_dtype=torch.float32,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.grad_scale_func = optimizer.scale_loss
    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=cfg.lr / 10,
        max_lr=cfg.lr,
        min_lr=cfg.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(cfg.steps, warmup + 1),
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=max(cfg.steps, 1),
        wd_incr_style="constant",
    )
    return model, ddp, optimizer, scheduler


def _load_init(model: Any, cfg: DemoConfig) -> None:
    """Load ``cfg.init_weights`` (whole model, TP = 1) into this rank's stage and TP shard.

    A tensor-parallel parameter is the whole one cut into ``tp`` equal slices along the one
    dimension whose size differs (megatron's QKV rows are grouped per query group, so a
    contiguous slice is this rank's heads); this rank takes its slice.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    source = torch.load(cfg.init_weights, map_location="cpu", weights_only=True)
    local = model.state_dict()
    names = global_weights(model, get_transformer_layer_offset(model.config))
    rank, out = ps.get_tensor_model_parallel_rank(), {}
    for mine, name in zip(local, names, strict=True):
        if not isinstance(local[mine], torch.Tensor):
            out[mine] = local[mine]
            continue
        if name not in source:
            raise EssPatchValueError(
                f"init_weights {cfg.init_weights}: no {name!r} (another model?)"
            )
        value = source[name]
        dims = [d for d, (a, b) in enumerate(zip(local[mine].shape, value.shape)) if a != b]
        if dims:
            if len(dims) != 1 or value.shape[dims[0]] != local[mine].shape[dims[0]] * cfg.tp:
                raise EssPatchValueError(
                    f"init_weights {cfg.init_weights}: {name!r} has shape "
                    f"{tuple(value.shape)}, this rank's {tuple(local[mine].shape)} (tp={cfg.tp})"
                )
            value = value.chunk(cfg.tp, dim=dims[0])[rank]
        out[mine] = value.to(local[mine].device, local[mine].dtype)
    model.load_state_dict(out, strict=True)


def _publish(model: Any, lay: _Layout, cfg: DemoConfig) -> dict[str, Any]:
    """The whole current policy under whole-model names, on every rank (PP: all-gather)."""
    mine = global_weights(model, lay.layer_offset)
    if cfg.pp == 1:
        return mine
    parts: list[Any] = [None] * cfg.pp
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in mine.items()}
    dist.all_gather_object(parts, cpu, group=lay.pp_group)
    whole: dict[str, Any] = {}
    for part in parts:
        whole.update(part)
    return {k: v.to(cfg.device) if isinstance(v, torch.Tensor) else v for k, v in whole.items()}


def _digest(weights: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        value = weights[name]
        if isinstance(value, torch.Tensor):
            h.update(name.encode())
            h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class _Rollout:
    prompts: torch.Tensor  # [N, P]
    tokens: torch.Tensor  # [N, T]
    logp: torch.Tensor  # [N, T] bf16 engine's log-probs (float32 values)
    lags: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]


def _sample(
    cfg: DemoConfig,
    engine: RolloutEngine,
    versions: deque,
    step: int,
    lay: _Layout,
    lag: int,
    tape: RolloutTape | None = None,
) -> _Rollout:
    """This DP rank's rollout: each worker samples its prompts' groups from its weights
    (or, replaying a tape, scores the recorded tokens with them)."""
    device = cfg.device
    gen = torch.Generator(device=device).manual_seed(
        (cfg.seed * 1_000_003 + step) * 1009 + lay.dp_rank
    )
    n = cfg.response_len
    prompt_gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1013 + lay.dp_rank)
    prompts = task_mod.make_prompts(cfg.task, n, cfg.prompts_per_rank, prompt_gen).to(device)
    lags_by_worker = rollout_lags(cfg, step, lag)
    owner = torch.arange(cfg.prompts_per_rank) % cfg.rollout_workers
    rows = cfg.rollouts_per_rank
    tokens = torch.empty(rows, n, dtype=torch.long, device=device)
    logp = torch.empty(rows, n, dtype=torch.float32, device=device)
    lags = torch.empty(rows, dtype=torch.long)
    expanded = prompts.repeat_interleave(cfg.group_size, dim=0)
    available = len(versions) - 1
    replay = tape.tokens(step, (rows, n)).to(device) if tape and tape.replaying else None
    # workers whose weights are equally old hold the same weights: one engine pass for them
    for lag in sorted(set(lags_by_worker)):
        workers = [w for w, x in enumerate(lags_by_worker) if x == lag]
        mine = torch.isin(owner, torch.tensor(workers)).nonzero().flatten()
        if not mine.numel():
            continue
        idx = (mine[:, None] * cfg.group_size + torch.arange(cfg.group_size)).flatten()
        engine.load(versions[-1 - min(lag, available)])
        if replay is None:
            out = engine.sample(expanded[idx.to(device)], n, gen)
        else:
            out = engine.score(expanded[idx.to(device)], replay[idx.to(device)])
        tokens[idx.to(device)] = out.tokens
        logp[idx.to(device)] = out.logp
        lags[idx] = min(lag, available)
    if tape is not None:
        tape.record(step, tokens)
    r = task_mod.rewards(tokens, task_mod.targets(cfg.task, expanded, n))
    grouped = r.view(-1, cfg.group_size)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    return _Rollout(expanded, tokens, logp, lags, r, adv)


def _loss(cfg: DemoConfig, batch: dict[str, torch.Tensor], stash: list, logits: torch.Tensor):
    """The policy-gradient loss of one micro-batch (last stage), per-token mean."""
    logp = response_logprobs(logits, batch["tokens"])
    stash.append(logp.detach())
    log_ratio = logp.detach() - batch["rollout_logp"]
    adv = batch["advantages"][:, None]
    if cfg.loss == "sequence":
        seq = log_ratio.sum(dim=1, keepdim=True)
        weight = torch.exp(seq.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        clamped = (seq.abs() > MAX_LOG_RATIO).sum()
    elif cfg.loss == "seq-tis":  # VCPO: min(exp(sum), c) for every token, no PPO clip
        seq = log_ratio.sum(dim=1, keepdim=True)
        weight = torch.exp(seq.clamp(max=math.log(cfg.is_threshold)))
        clamped = (seq > math.log(cfg.is_threshold)).sum()
    else:  # miles/slime TIS: truncated per-token weight, no gradient through it
        weight = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO)).clamp(max=cfg.tis_clip)
        clamped = (log_ratio > MAX_LOG_RATIO).sum()
    extra = {}
    if "group_ids" in batch:  # a proxy arm: b* from the logits this forward computed
        from .opob import proxy_advantages

        adv, extra["proxy_abs_shift"] = proxy_advantages(
            batch["rewards"],
            batch["group_ids"],
            logits[:, -logp.shape[1] :],
            batch["tokens"],
            weight,
        )
    loss = -(adv * weight * logp).mean()
    with torch.no_grad():  # the trainer's per-token entropy on the response positions
        lsm = torch.log_softmax(logits[:, -logp.shape[1] :].detach().float(), dim=-1)
        entropy = -(lsm.exp() * lsm).sum(dim=-1).sum()
    return loss, {"loss": loss.detach(), "clamped": clamped, "entropy": entropy, **extra}


def _shim(cfg: DemoConfig) -> Any:
    """What megatron's calls run in: the CPU shim on a CPU, nothing on a GPU."""
    if cfg.device == "cpu":
        from .cpu import megatron_on_cpu

        return megatron_on_cpu
    return contextlib.nullcontext


def _forward_step(cfg: DemoConfig, stash: list, data_iterator: Any, model_chunk: Any):
    """megatron's forward-step contract: this stage's output and the loss function."""
    batch = next(data_iterator)
    out = model_chunk(batch["input_ids"], batch["position_ids"], None, runtime_gather_output=True)
    return out, partial(_loss, cfg, batch, stash)


def _train_arm(
    cfg: DemoConfig, arm_name: str, progress: Any, constant: float
) -> tuple[list[dict[str, Any]], list[float], bool]:
    """One arm's run; returns the writer's records, the scale of each step, is-writer."""
    from megatron.core import parallel_state as ps

    torch.manual_seed(cfg.seed)
    if cfg.device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.seed)
    # megatron's code runs inside the CPU shim (demo only); ess-patch's own calls outside it,
    # as they run in production
    shim = _shim(cfg)
    with shim():
        model, ddp, optimizer, scheduler = _build(cfg)
        engine = RolloutEngine(cfg.spec, tp=cfg.tp, device=cfg.device)
    lay = _Layout.current(model.config)
    last = ps.is_pipeline_last_stage()
    glue = _baseline_glue(arm_name, model, ddp, lay)
    group_ids = torch.arange(cfg.prompts_per_rank).repeat_interleave(cfg.group_size)
    writer = is_writer(cfg, lay)
    tape = _tape(cfg, arm_name, lay)

    applied, hooks = _lr_recorder(optimizer)
    ess_config = cfg.ess_config(arm_name)
    lag = 0 if arm_name == "sync" else cfg.lag
    if arm_name == "constant" and cfg.constant_scale is not None:
        constant = cfg.constant_scale
    calibration.restart()  # each arm is a run of its own (calibrate_rollouts)
    scales: list[float] = []
    versions: deque[dict[str, Any]] = deque([_publish(model, lay, cfg)], maxlen=lag + 1)
    mb = cfg.rollouts_per_rank // cfg.microbatches
    masks = [torch.ones(cfg.response_len, device=cfg.device) for _ in range(cfg.rollouts_per_rank)]
    records = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        with shim():
            roll = _sample(cfg, engine, versions, step, lay, lag, tape)
        t1, c1 = time.perf_counter(), time.thread_time()

        micro = _micro_batches(cfg, arm_name, roll, mb, ones=glue is not None)
        stash: list[torch.Tensor] = []  # the last stage's log-probs, per micro-batch
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        if glue is not None:
            glue.begin(roll.rewards, group_ids)
        with shim():
            losses = _forward_backward(cfg, ddp, micro, stash)
        t2, c2 = time.perf_counter(), time.thread_time()

        # ESS over the step's trajectories: every rank, the last stage's log-probs
        logp = torch.cat(stash) if last else None
        scale, rho, ess = _arm_step(cfg, arm_name, ess_config, logp, roll, masks, lay, constant)
        scales.append(scale)
        t3, c3 = time.perf_counter(), time.thread_time()

        with shim():
            scheduled, ok, grad_norm = _optimizer_step(optimizer, scheduler, applied)
        t4, c4 = time.perf_counter(), time.thread_time()

        versions.append(_publish(model, lay, cfg))
        t5 = time.perf_counter()

        stats = _step_stats(cfg, logp, roll, losses, lay) if last else None
        if writer:
            assert stats is not None
            rec = {
                "arm": arm_name,
                "step": step,
                **stats,
                **_ess_fields(cfg, rho, ess, lag, scale),
                **_lr_fields(scheduled, applied, grad_norm, ok),
                **_time_fields((t0, t1, t2, t3, t4, t5), (c1, c2, c3, c4)),
            }
            rec.update(_baseline_fields(arm_name, glue, losses))
            if step == cfg.steps - 1:
                rec["weights_sha256"] = _digest(versions[-1])
            records.append(rec)
            if progress is not None:
                progress.put((arm_name, step))
    _teardown(cfg, hooks, glue)
    return records, scales, writer


def _teardown(cfg: DemoConfig, hooks: list[Any], glue: Any) -> None:
    """Leave nothing of the arm behind: the LR hooks, the glue's hooks, the armed scale."""
    for hook in hooks:
        hook.remove()
    if glue is not None:
        glue.remove()
    if cfg.install_ess:
        disarm()


def _optimizer_step(optimizer: Any, scheduler: Any, applied: list[float]) -> tuple:
    """megatron's optimizer step and the scheduler's: (the scheduled LRs, ok, grad norm);
    ``applied`` gets the LRs the step applied."""
    scheduled = [group["lr"] for group in optimizer.param_groups]
    applied.clear()
    ok, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    return scheduled, ok, grad_norm


def _ess_fields(cfg: DemoConfig, rho: float, ess: float, lag: int, scale: float) -> dict:
    """A record's ESS fields: rho, ESS, the batch, the lag and the scale armed."""
    return {
        "rho": rho,
        "ess": ess,
        "num_trajectories": cfg.rollouts_per_rank * cfg.dp,
        "lag_max": lag,
        "lr_scale": scale,
    }


def _lr_recorder(optimizer: Any) -> tuple[list[float], list[Any]]:
    """A list that each leaf optimizer's ``step`` fills with the LRs it applies, and the hooks
    (to remove)."""
    applied: list[float] = []

    def record_lr(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        applied.extend(group["lr"] for group in opt.param_groups)

    hooks = [
        leaf.optimizer.register_step_pre_hook(record_lr)
        for leaf in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    return applied, hooks


def _forward_backward(cfg: DemoConfig, ddp: Any, micro: list[dict], stash: list) -> Any:
    """megatron's schedule over the step's micro-batches (the last stage's log-probs go to
    ``stash``); returns the losses' reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n, mb = cfg.response_len, cfg.rollouts_per_rank // cfg.microbatches
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, cfg, stash),
        data_iterator=iter(micro),
        model=[ddp],
        num_microbatches=cfg.microbatches,
        seq_length=task_mod.prompt_length(cfg.task, n) + n - 1,
        micro_batch_size=mb,
        forward_only=False,
    )


def _baseline_fields(arm_name: str, glue: Any, losses: Any) -> dict[str, Any]:
    """A record's baseline fields: the glue's metrics (averaged over DP in finalize: reading
    them is local) and, for the proxy arms, the mean |b* - group mean| over this rank's
    micro-batches (the demo's groups stay local)."""
    out = {f"opob_{k}": v for k, v in (glue.metrics() if glue is not None else {}).items()}
    if arm_name in PROXY_ARMS:
        shifts = [float(x["proxy_abs_shift"]) for x in losses]
        out["opob_proxy_abs_shift"] = sum(shifts) / len(shifts)
    return out


def _baseline_glue(arm_name: str, model: Any, ddp: Any, lay: _Layout) -> Any:
    """The baseline arms' glue (b* and the rewrite in finalize), None for the other arms."""
    if arm_name not in BASELINE_ARMS:
        return None
    from megatron.core import parallel_state as ps

    from .opob import BaselineGlue

    return BaselineGlue(
        model,
        ddp,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=lay.pp_group,
        dp_group=lay.dp_group,
    )


def _tape(cfg: DemoConfig, arm_name: str, lay: _Layout) -> RolloutTape | None:
    """The rollout tape this rank records or replays, if the config names one."""
    if not cfg.rollout_tape:
        return None
    return RolloutTape(
        cfg.rollout_tape,
        cfg.tape_mode,
        arm_name,
        lay.dp_rank,
        writes=lay.tp_rank == 0 and lay.pp_rank == 0,
    )


def _micro_batches(
    cfg: DemoConfig, arm_name: str, roll: _Rollout, mb: int, *, ones: bool
) -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches of ``mb`` rollouts; ``ones``: advantage 1 (the baseline glue
    rewrites it to R - b* in finalize). The proxy arms also carry rewards and group ids."""
    ids, pos = train_inputs(roll.prompts, roll.tokens)
    adv = torch.ones_like(roll.advantages) if ones else roll.advantages
    return [
        {
            "input_ids": ids[i : i + mb],
            "position_ids": pos[i : i + mb],
            "tokens": roll.tokens[i : i + mb],
            "rollout_logp": roll.logp[i : i + mb],
            "advantages": adv[i : i + mb].to(cfg.device),
            **(
                {
                    "rewards": roll.rewards[i : i + mb].to(cfg.device),
                    "group_ids": torch.arange(mb, device=cfg.device) // cfg.group_size,
                }
                if arm_name in PROXY_ARMS
                else {}
            ),
        }
        for i in range(0, cfg.rollouts_per_rank, mb)
    ]


def _arm_step(
    cfg: DemoConfig,
    arm_name: str,
    ess_config: EssLrConfig,
    logp: torch.Tensor | None,
    roll: _Rollout,
    masks: list[torch.Tensor],
    lay: _Layout,
    constant: float,
) -> tuple[float, float, float]:
    """ESS over the step's trajectories (every rank; the last stage's log-probs), then the
    arm's scale armed for the coming optimizer step: (scale, rho, ess)."""
    if not cfg.install_ess:
        return 1.0, math.nan, math.nan
    last = logp is not None
    result = compute_ess_lr(
        list(logp) if last else None,
        list(roll.logp) if last else None,
        masks,
        config=ess_config,
        dp_group=lay.dp_group,
        pp_group=lay.pp_group,
    )
    if arm_name in ("off", "sync", "baseline", "proxy"):
        disarm()
        scale = 1.0
    elif arm_name == "constant":
        scale = arm(constant).scale
    else:
        scale = arm(result).scale
    return scale, result.rho, result.ess


def _lr_fields(scheduled: list[float], applied: list[float], grad_norm: Any, ok: Any) -> dict:
    """A record's LR and update fields: the scheduled LRs and those the optimizer applied."""
    return {
        "scheduled_lr": scheduled[0],
        "applied_lr": applied[0] if applied else math.nan,
        "scheduled_lrs": scheduled,
        "applied_lrs": list(applied),
        "grad_norm": math.nan if grad_norm is None else float(grad_norm),
        "update_successful": bool(ok),
    }


def _time_fields(wall: tuple[float, ...], cpu: tuple[float, ...]) -> dict[str, float]:
    """A record's timings from the step's wall-clock marks t0..t5 and CPU marks c1..c4."""
    t0, t1, t2, t3, t4, t5 = wall
    c1, c2, c3, c4 = cpu
    return {
        "time_sample_s": t1 - t0,
        "time_train_s": (t2 - t1) + (t4 - t3),
        "time_ess_s": t3 - t2,
        "time_publish_s": t5 - t4,
        # this thread's CPU time: the work itself, without waiting for peers
        "cpu_train_s": (c2 - c1) + (c4 - c3),
        "cpu_ess_s": c3 - c2,
    }


def _step_stats(
    cfg: DemoConfig, logp: torch.Tensor, roll: _Rollout, losses: Any, lay: _Layout
) -> dict[str, float]:
    """Reward, lag, loss and train/rollout mismatch over the global batch (all DP ranks)."""
    log_ratio = (logp - roll.logp).double()  # log(policy / rollout) per token
    diff = log_ratio.abs()
    # KL(rollout || policy) per token from the rollout's own samples: k1 = E[-log r] and
    # the nonnegative k3 = E[r - 1 - log r], r = policy / rollout
    r = log_ratio.clamp(max=MAX_LOG_RATIO)
    fresh = (roll.lags == 0).to(diff.device)
    clamped = sum(float(x["clamped"]) for x in losses)
    sums = torch.tensor(
        [
            diff.sum().item(),
            float(diff.numel()),
            diff[fresh].sum().item(),
            float(fresh.sum().item() * cfg.response_len),
            roll.rewards.double().sum().item(),
            roll.lags.double().sum().item(),
            float(roll.rewards.numel()),
            sum(float(x["loss"]) for x in losses),
            clamped,
            sum(float(x["entropy"]) for x in losses),
            (-log_ratio).sum().item(),
            (r.exp() - 1 - r).sum().item(),
        ],
        dtype=torch.float64,
        device=diff.device,
    )
    if cfg.dp > 1:
        dist.all_reduce(sums, group=lay.dp_group)
    (abs_sum, count, fresh_sum, fresh_count, reward, lag, rows, loss, clamped, ent, k1, k3) = (
        sums.tolist()
    )
    return {
        "reward": reward / rows,
        "mean_lag": lag / rows,
        "mismatch": abs_sum / count,
        "mismatch_lag0": fresh_sum / fresh_count if fresh_count else math.nan,
        "loss": loss / (cfg.dp * cfg.microbatches),
        "clamped": int(clamped),
        "entropy": ent / count,
        "kl_k1": k1 / count,
        "kl": k3 / count,
    }
