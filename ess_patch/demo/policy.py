"""The demo's policy: a tiny megatron-core ``GPTModel``, its bf16 rollout engine, train log-probs.

Three pieces, used by the demo's ranks and importable on their own (e.g. to measure rho
against response length)::

    from ess_patch.demo.policy import PolicySpec, RolloutEngine, build_policy, single_process
    from ess_patch.demo.policy import train_logprobs
    from ess_patch.demo import task

    spec = PolicySpec(max_len=2 * 64 + 2)  # room for prompt + response
    with single_process():  # gloo world of 1 + megatron parallel_state + the CPU shim
        torch.manual_seed(0)
        model = build_policy(spec)  # fp32 trainer model (megatron GPTModel, local spec)
        engine = RolloutEngine(spec)  # the same architecture in bf16, with a KV cache
        engine.load(model.state_dict())  # a weight update: fp32 -> bf16 copy
        gen = torch.Generator().manual_seed(0)
        prompts = task.make_prompts("sort", 64, 32, gen)
        out = engine.sample(prompts, 64, gen)  # tokens [32, 64], rollout logp [32, 64]
        logp = train_logprobs(model, prompts, out.tokens)  # fp32, differentiable
        mismatch = (logp.detach() - out.logp).abs().mean()  # ~1e-3 nats/token at lag 0

* :func:`build_policy`: the trainer's model, ``GPTModel`` with megatron's local
  (``transformer_impl="local"``) layer spec, fp32, no dropout, untied input/output
  embeddings, learned absolute positions; built for this rank's pipeline stage and tensor
  parallel shard (``parallel_state`` must be initialised; one rank is fine).
* :class:`RolloutEngine`: the inference side of an async RL system. It holds its *own* copy
  of the whole model (every layer, whatever the trainer's pipeline layout; the same tensor
  parallel sharding) in bf16 (megatron's ``Float16Module``), loads weights the trainer
  publishes, and samples autoregressively with megatron's ``StaticInferenceContext`` (a KV
  cache: one forward over the prompt, then one single-token forward per response token).
  The log-probs it records are those of its bf16 logits (log-softmax taken in fp32, as
  inference engines report them), so they differ from the fp32 trainer's even for the same
  weights: the train/rollout mismatch exists at lag 0, as in production.
* :func:`train_logprobs`: the fp32 trainer's log-probs of given responses (one forward over
  prompt + response, teacher forcing), with autograd. :func:`response_logprobs` does the
  same from logits the caller already has (the pipeline schedule's last stage).

Measured on this project's 2-core CPU box (one thread, under load from other jobs; see
``docs/demo.md``): the KV-cache sampler is several times faster than re-running the full
forward for every new token, which is what the module uses.

Everything runs inside :func:`ess_patch.demo.cpu.megatron_on_cpu` on a CPU-only torch
(``single_process`` enters it); on a GPU build the same code runs on the current CUDA device
when ``device="cuda"`` is given.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import EssPatchRuntimeError, EssPatchValueError
from .task import VOCAB

__all__ = [
    "PolicySpec",
    "Rollout",
    "RolloutEngine",
    "build_policy",
    "global_weights",
    "response_logprobs",
    "single_process",
    "train_logprobs",
    "transformer_config",
]


@dataclass(frozen=True)
class PolicySpec:
    """The architecture (the same on every rank, trainer and rollout engine)."""

    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = VOCAB
    #: Longest prompt + response the model is built for (learned position embeddings).
    max_len: int = 64

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "vocab", "max_len"):
            if getattr(self, name) < 1:
                raise EssPatchValueError(f"PolicySpec.{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.heads:
            raise EssPatchValueError(f"PolicySpec: hidden {self.hidden} is not a multiple of heads")


def transformer_config(
    spec: PolicySpec,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Any:
    """megatron's ``TransformerConfig`` for ``spec`` (fp32 trainer or bf16 engine)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        # the layout first, then the model's sizes
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        # CPU init draws the full weight from torch's RNG, then shards it: the same seed gives
        # the same model under every tensor-parallel size.
        use_cpu_initialization=device == "cpu",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # p2p on gloo: no torch.cuda.synchronize() after batched send/recv
        batch_p2p_comm=False,
        variable_seq_lengths=False,
    )


def build_policy(
    spec: PolicySpec,
    *,
    tp: int = 1,
    pp: int = 1,
    pre_process: bool = True,
    post_process: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Any:
    """A ``GPTModel`` (local spec) for this rank's pipeline stage; parameters from torch's RNG.

    ``pre_process`` / ``post_process``: this stage holds the embedding / the output layer
    (``parallel_state.is_pipeline_first_stage()`` / ``is_pipeline_last_stage()``).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(spec, tp=tp, pp=pp, dtype=dtype, device=device)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        pre_process=pre_process,
        post_process=post_process,
        vocab_size=spec.vocab,
        max_sequence_length=spec.max_len,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=False,
    )
    return model.to(device)


def _positions(batch: int, start: int, length: int, device: Any) -> torch.Tensor:
    return torch.arange(start, start + length, device=device)[None].expand(batch, length)


def response_logprobs(logits: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs of ``responses`` [B, T] from the logits of a teacher-forced forward.

    ``logits``: ``[B, L, V]`` over the input ``prompt + response[:-1]`` (``L = P + T - 1``);
    the logits at position ``P - 1 + t`` predict response token ``t``.
    """
    t = responses.shape[1]
    logp = torch.log_softmax(logits[:, -t:].float(), dim=-1)
    return logp.gather(2, responses[..., None]).squeeze(-1)


def train_inputs(prompts: torch.Tensor, responses: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(input_ids, position_ids)`` of the teacher-forced forward over prompt + response."""
    ids = torch.cat([prompts, responses[:, :-1]], dim=1)
    return ids, _positions(ids.shape[0], 0, ids.shape[1], ids.device)


def train_logprobs(model: Any, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """The fp32 trainer's log-probs of ``responses`` given ``prompts``: ``[B, T]``, with grad.

    One forward of a whole (single-stage) model; causal attention (megatron's default mask).
    """
    ids, pos = train_inputs(prompts, responses)
    logits = model(ids, pos, None, runtime_gather_output=True)
    return response_logprobs(logits, responses)


@dataclass(frozen=True)
class Rollout:
    """What the rollout engine returns for a batch of prompts."""

    tokens: torch.Tensor  # [B, T] long: the sampled response
    logp: torch.Tensor  # [B, T] float32: log-probs of the bf16 engine at sampling time


class RolloutEngine:
    """A bf16 copy of the whole policy that samples with a KV cache (see the module docstring).

    Build it on every rank of a tensor-parallel group alike (its linear layers are sharded
    the same way as the trainer's); sample with the same generator state on those ranks so
    that they draw the same tokens.
    """

    def __init__(
        self,
        spec: PolicySpec,
        *,
        tp: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
    ) -> None:
        from megatron.core.transformer.module import Float16Module

        self.spec = spec
        self.dtype = dtype
        # every layer on this rank (pipeline size 1 in its config), whatever the trainer's PP
        inner = build_policy(spec, tp=tp, pp=1, dtype=dtype, device=device)
        inner.eval()
        self._inner = inner
        self.model = (
            Float16Module(inner.config, inner)
            if dtype in (torch.bfloat16, torch.float16)
            else inner
        )

    @torch.no_grad()
    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Publish trainer weights to the engine (whole-model names, as :func:`global_weights`).

        Raises:
            RuntimeError: a name is missing or unexpected (load_state_dict's strict check).
        """
        self._inner.load_state_dict(dict(weights), strict=True)

    @torch.no_grad()
    def sample(
        self,
        prompts: torch.Tensor,
        response_len: int,
        generator: torch.Generator,
        *,
        temperature: float = 1.0,
    ) -> Rollout:
        """Sample ``response_len`` tokens after each prompt (all prompts the same length)."""

        def draw(lp: torch.Tensor, t: int) -> torch.Tensor:
            return torch.multinomial(lp.exp(), 1, generator=generator)

        return self._decode(prompts, response_len, draw, temperature)

    @torch.no_grad()
    def score(
        self, prompts: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0
    ) -> Rollout:
        """The engine's log-probs of given responses, teacher-forced through the same
        KV-cache pass as :meth:`sample` (so a run can replay another run's tokens)."""
        if tokens.shape[0] != prompts.shape[0]:
            raise EssPatchValueError(
                f"score: {tokens.shape[0]} responses for {prompts.shape[0]} prompts; give one each"
            )

        def forced(lp: torch.Tensor, t: int) -> torch.Tensor:
            return tokens[:, t : t + 1].to(lp.device)

        return self._decode(prompts, tokens.shape[1], forced, temperature)

    def _decode(
        self,
        prompts: torch.Tensor,
        response_len: int,
        pick: Callable[[torch.Tensor, int], torch.Tensor],
        temperature: float,
    ) -> Rollout:
        from megatron.core.inference.contexts import StaticInferenceContext

        b, p = prompts.shape
        if p + response_len > self.spec.max_len:
            raise EssPatchValueError(
                f"prompt {p} + response {response_len} tokens exceed the model's max_len "
                f"{self.spec.max_len}: build the PolicySpec with a larger max_len"
            )
        ctx = StaticInferenceContext(b, p + response_len)
        tokens = torch.empty(b, response_len, dtype=torch.long, device=prompts.device)
        logp = torch.empty(b, response_len, dtype=torch.float32, device=prompts.device)
        step_in, pos = prompts, _positions(b, 0, p, prompts.device)
        for t in range(response_len):
            logits = self.model(
                step_in, pos, None, inference_context=ctx, runtime_gather_output=True
            )
            ctx.sequence_len_offset += step_in.shape[1]
            # the engine's logits are bf16; inference engines report fp32 log-softmax of them
            lp = torch.log_softmax(logits[:, -1].float() / temperature, dim=-1)
            tok = pick(lp, t)
            tokens[:, t] = tok[:, 0]
            logp[:, t] = lp.gather(1, tok)[:, 0]
            step_in, pos = tok, _positions(b, ctx.sequence_len_offset, 1, prompts.device)
        return Rollout(tokens, logp)


def global_weights(model: Any, layer_offset: int = 0) -> dict[str, Any]:
    """This stage's parameters under whole-model names (detached copies).

    A pipeline stage numbers its layers from 0; ``layer_offset`` (megatron's
    ``get_transformer_layer_offset``) turns ``decoder.layers.<i>.`` into the whole model's
    ``decoder.layers.<offset + i>.``.
    """
    out: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):  # megatron's per-layer ``_extra_state`` (None)
            out[name] = value
            continue
        if name.startswith("decoder.layers."):
            decoder, layers, index, rest = name.split(".", 3)
            name = f"{decoder}.{layers}.{int(index) + layer_offset}.{rest}"
        out[name] = value.detach().clone()
    return out


@contextlib.contextmanager
def single_process(directory: str | None = None) -> Iterator[None]:
    """A gloo world of one rank with megatron's ``parallel_state`` (TP = PP = CP = 1) and the
    CPU shim entered: enough to build, sample and train the policy in this process.

    Raises:
        RuntimeError: a torch.distributed process group already exists in this process.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from .cpu import megatron_on_cpu

    if dist.is_initialized():
        raise EssPatchRuntimeError(
            "single_process(): torch.distributed is already initialised in this process; "
            "initialise megatron's parallel_state yourself and use build_policy directly"
        )
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
        try:
            ps.initialize_model_parallel(create_gloo_process_groups=False)
            with megatron_on_cpu():
                yield
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
