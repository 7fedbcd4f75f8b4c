"""Call sites for source trees patched with the diffs in ``patches/`` (no monkeypatching).

The diffs only add an import and a decorator; the behaviour lives here, shared with the
wrapt wrappers that ``install()`` applies. Functions decorated here carry a mark, so that
``install()`` sees a vendored tree and does not wrap it a second time. Which definition gets
which decorator is written once, on the integrations' targets (``Target.decorator``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .integrations import Integration
from .integrations import megatron_rl as _megatron_rl
from .integrations import miles as _miles
from .integrations import slime as _slime
from .integrations import verl as _verl
from .integrations.loss_ledger import log_probs_wrapper, policy_loss_wrapper
from .integrations.miles import MILES_FRAMEWORK
from .integrations.miles_slime import advantage_wrapper, critic_wrapper, parse_args_wrapper
from .integrations.registry import COMMIT, COMPONENTS, DECORATORS
from .integrations.slime import SLIME_FRAMEWORK
from .lr import step_wrapper
from .patching import VENDORED_MARK, is_vendored
from .state import note_applier

# the decorators are the registry's names (tests/test_registry.py checks each is defined here)
__all__ = ["CALL_SITES", "CallSite", "call_sites", "is_vendored", *DECORATORS]

F = TypeVar("F", bound=Callable[..., Any])


def _function_hook(wrapper: Callable[..., Any]) -> Callable[[F], F]:
    """A decorator running a module-level function through one of install()'s wrappers."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            return wrapper(function, None, args, kwargs)

        setattr(call, VENDORED_MARK, True)
        return call  # type: ignore[return-value]

    return decorate


def _method_hook(wrapper: Callable[..., Any]) -> Callable[[F], F]:
    """The same for a method: the wrapper gets the instance, as wrapt gives it."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(functools.partial(method, self), self, args, kwargs)

        setattr(call, VENDORED_MARK, True)
        return call  # type: ignore[return-value]

    return decorate


#: megatron-core: on every optimizer ``step`` / ``step_with_ready_grads`` install() wraps.
_optimizer_step_hook = _method_hook(step_wrapper)


def optimizer_step(method: F) -> F:
    """Decorate an optimizer's ``step`` / ``step_with_ready_grads`` (the megatron-core diff)."""
    note_applier()  # arm() then has an effect without install()
    return _optimizer_step_hook(method)


#: miles ``utils/arguments.py``: ``@miles_parse_args`` on ``parse_args``.
miles_parse_args = _function_hook(parse_args_wrapper(MILES_FRAMEWORK))
#: miles ``training_utils/loss.py``: on ``compute_advantages_and_returns``.
miles_advantages = _function_hook(advantage_wrapper(MILES_FRAMEWORK))
#: miles ``training_utils/log_utils.py``: on ``log_train_step``.
miles_log_train_step = _function_hook(_miles.log_train_step_wrapper)
#: miles ``fsdp_utils/actor.py``: on ``FSDPTrainRayActor._train_core``.
miles_fsdp_train_core = _method_hook(_miles.fsdp_train_core_wrapper)
#: slime ``utils/arguments.py``: on ``parse_args``.
slime_parse_args = _function_hook(parse_args_wrapper(SLIME_FRAMEWORK))
#: slime ``backends/megatron_utils/loss.py``: on ``compute_advantages_and_returns``.
slime_advantages = _function_hook(advantage_wrapper(SLIME_FRAMEWORK))
#: miles ``megatron_utils/actor.py``: on ``MegatronTrainRayActor.train_critic``.
miles_train_critic = _method_hook(critic_wrapper)
#: slime ``megatron_utils/actor.py``: on ``MegatronTrainRayActor.train_critic``.
slime_train_critic = _method_hook(critic_wrapper)
#: slime ``observability/logging_utils.py``: on ``log``.
slime_log = _function_hook(_slime.log_wrapper)
#: slime ``backends/megatron_utils/loss.py``: ``@slime_policy_loss`` on ``policy_loss_function``
#: and ``@slime_log_probs`` on ``get_log_probs_and_entropy`` (ESS measured inside the loss).
slime_policy_loss = _function_hook(policy_loss_wrapper)
slime_log_probs = _function_hook(log_probs_wrapper)
#: miles ``training_utils/loss_hub``: ``@miles_policy_loss`` on ``losses.policy_loss_function``,
#: ``@miles_log_probs`` on ``logit_processors.get_log_probs_and_entropy``.
miles_policy_loss = _function_hook(policy_loss_wrapper)
miles_log_probs = _function_hook(log_probs_wrapper)
#: Megatron-LM ``megatron/training/arguments.py``: on ``parse_args`` (Megatron-RL runs only).
megatron_rl_parse_args = _function_hook(_megatron_rl.parse_args_wrapper)
#: Megatron-LM ``megatron/rl/rl_utils.py``: on ``prepare_data_for_update``.
megatron_rl_prepare = _function_hook(_megatron_rl.prepare_wrapper)
#: Megatron-LM ``megatron/rl/rl_utils.py``: on ``align_unpacked_inference_logprobs``.
megatron_rl_align = _function_hook(_megatron_rl.align_wrapper)
#: Megatron-LM ``megatron/rl/sequence_packing_utils.py``: on
#: ``compute_packed_inference_logprobs_stats``.
megatron_rl_packed_stats = _function_hook(_megatron_rl.packed_stats_wrapper)
#: Megatron-LM ``megatron/rl/rl_utils.py``: on ``maybe_log_training_metrics``.
megatron_rl_log_metrics = _function_hook(_megatron_rl.log_metrics_wrapper)
#: verl ``workers/actor/megatron_actor.py``: on ``MegatronPPOActor.make_minibatch_iterator``.
verl_minibatch_iterator = _method_hook(_verl.minibatch_iterator_wrapper)
#: verl ``workers/actor/megatron_actor.py``: on ``MegatronPPOActor.update_policy``.
verl_update_policy = _method_hook(_verl.update_policy_wrapper)
#: verl ``workers/engine_workers.py``: on ``ActorRolloutRefWorker.update_actor`` (engine path).
verl_engine_update_actor = _method_hook(_verl.engine_update_actor_wrapper)
#: verl ``workers/engine_workers.py``: on ``TrainingWorker.train_batch`` (engine path).
verl_engine_train_batch = _method_hook(_verl.engine_train_batch_wrapper)
#: verl ``workers/actor/dp_actor.py``: on ``DataParallelPPOActor.update_policy`` (refused).
verl_fsdp_update_policy = _method_hook(_verl.fsdp_update_policy_wrapper)
#: verl ``workers/engine_workers_tinker.py`` (main): on ``TinkerActorRolloutRefWorker``'s
#: ``forward_backward`` and ``optimizer_step`` (refused while ESS-LR is on).
verl_tinker_forward_backward = _method_hook(_verl.tinker_wrapper)
verl_tinker_optimizer_step = _method_hook(_verl.tinker_wrapper)
#: verl ``utils/config.py``: on ``omega_conf_to_dataclass``.
verl_omega_conf_to_dataclass = _function_hook(_verl.config_wrapper)
#: verl ``trainer/constants_ppo.py``: on ``get_ppo_ray_runtime_env`` (the driver).
verl_get_ppo_ray_runtime_env = _function_hook(_verl.runtime_env_wrapper)


@dataclass(frozen=True)
class CallSite:
    """Where a diff (``patches/<component>/``) puts one of the decorators above.

    ``path``: the file, relative to the tree root; ``owner``: the class ("" for a module-level
    function); ``function``: what is decorated; ``decorator``: the name in this module. The
    diff imports it as ``_ess_<decorator>`` (guarded: the identity without ess_patch).
    """

    path: str
    owner: str
    function: str
    decorator: str

    @property
    def alias(self) -> str:
        return f"_ess_{self.decorator}"

    @property
    def label(self) -> str:
        return ".".join(p for p in (self.owner, self.function) if p)


def call_sites(integration: Integration) -> tuple[CallSite, ...]:
    """The definitions a diff decorates: the integration's targets that name a decorator
    (re-imports by name elsewhere, e.g. ``from ...loss import compute_advantages_and_returns``
    in ``megatron_utils/actor.py``, then get the decorated function)."""
    return tuple(
        CallSite(t.module.replace(".", "/") + ".py", t.owner, t.attribute, t.decorator)
        for t in integration.targets
        if t.decorator
    )


#: Per framework (a commit-keyed series), its call sites: tools/framework_series.py writes the
#: diffs from this table; ``ess_patch.patchset`` checks them against install().
CALL_SITES: dict[str, tuple[CallSite, ...]] = {
    c.name: call_sites(c.integration) for c in COMPONENTS if c.series == COMMIT
}
