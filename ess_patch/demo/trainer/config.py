"""The demo trainer's config: :class:`DemoConfig`, its validation and the arms it runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ... import EssLrConfig
from ...errors import EssPatchError
from .. import task as task_mod
from ..policy import PolicySpec
from ..staleness import VARYING
from ..tape import TAPE_MODES

__all__ = [
    "ARMS",
    "BASELINE_ARMS",
    "DEFAULT_ARMS",
    "LOSSES",
    "MAX_LOG_RATIO",
    "PROXY_ARMS",
    "STALENESS",
    "DemoConfig",
    "DemoConfigError",
]

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
