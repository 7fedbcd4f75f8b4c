"""The norm pass over pipeline stages (``ess_patch.pipeline_pass``) in real gloo processes.

Two pipeline stages of a megatron-core GPTModel (RMSNorm, no bias, SwiGLU, GQA, rope; 4
layers, 2 a stage) with the weights of one process's whole model: every stage must end with
the squared norms one backward per trajectory gives on the whole model in one process, for
both paths, and with nothing changed (parameters, ``.grad``, ``requires_grad``). A stage that
fails stops both; tied embeddings over stages are refused by name on both.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

import pipeline_ranks
from harness import run_ranks


@pytest.fixture(scope="module")
def want():
    from ess_patch.demo.policy import single_process

    with single_process():
        return pipeline_ranks.brute(pipeline_ranks.gpt(), *pipeline_ranks.batch())


@pytest.mark.dist
@pytest.mark.parametrize("path", ["rules", "exact"])
def test_pp2_every_stage_gets_the_whole_models_norms(want, path, tmp_path):
    ranks = run_ranks(
        pipeline_ranks.pp2_norm_pass, pp=2, args=(path,), tmp_path=tmp_path, timeout=120
    )
    assert [r["stage"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["error"] is None, r
        got = torch.tensor(r["sq"], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=2e-5), (r["stage"], got, want)
        assert r["unchanged"] and r["grads"] == [] and r["frozen"] == []
    # each stage alone holds a real share: the sum is not one stage's
    assert want.min() > 0


@pytest.mark.dist
@pytest.mark.parametrize("path", ["rules", "exact"])
def test_a_failing_stage_stops_every_stage_with_its_own_error_named(path, tmp_path):
    # the last stage's loss (the backward never starts) and the first stage's forward (the
    # next stage never gets its input): the failing stage raises its own error, the other one
    # names it, and neither waits for a message that will not come (the launch is bounded)
    last = run_ranks(
        pipeline_ranks.pp2_norm_pass,
        pp=2,
        args=(path, "fail-last"),
        tmp_path=tmp_path / "last",
        timeout=120,
    )
    assert last[1]["error"] == "ValueError: the loss of the last stage failed on purpose"
    assert last[0]["error"].startswith("EssLrNotAppliedError") and "stage 1" in last[0]["error"]
    first = run_ranks(
        pipeline_ranks.pp2_norm_pass,
        pp=2,
        args=(path, "fail-first"),
        tmp_path=tmp_path / "first",
        timeout=120,
    )
    assert first[0]["error"] == "RuntimeError: the forward of the first stage failed on purpose"
    assert first[1]["error"].startswith("EssLrNotAppliedError") and "stage 0" in first[1]["error"]


@pytest.mark.dist
def test_tied_embeddings_over_stages_are_refused_on_every_stage(tmp_path):
    ranks = run_ranks(
        pipeline_ranks.pp2_norm_pass,
        pp=2,
        args=("rules", "tied"),
        tmp_path=tmp_path,
        timeout=120,
    )
    for r in ranks:
        assert r["error"].startswith("EssPatchValueError") and "untie" in r["error"], r
