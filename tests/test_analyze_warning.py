"""``ess-patch analyze`` prints the early warning: where the rule first fired and the rho there.

slime dumps (format 2) of rollouts whose policy drifts from the rollout policy, then collapses
(log-prob noise sigma up to 8: product rho ~1/8), against the float64 reference's rho with the
rule written out here.
"""

from __future__ import annotations

import pytest
from analyze_data import SIGMAS, make_rollout, save_slime_dump
from reference import reference_ess

from ess_patch.analyze import analyze
from ess_patch.cli import main

COLLAPSE = [0.05, 0.1, 0.3, 0.6, 1.2, 4.0, 5.0, 6.0, 8.0]


def _dumps(folder, sigmas):
    folder.mkdir()
    for rid, sigma in enumerate(sigmas):
        save_slime_dump(folder / f"{rid}_0.pt", rid, make_rollout(rid, sigma))
    return folder


def _rho(sigmas, mode):
    out = []
    for rid, sigma in enumerate(sigmas):
        s = make_rollout(rid, sigma)
        lp, rlp, masks = ([x[k] for x in s] for k in ("lp", "rlp", "mask"))
        out.append(reference_ess(lp, rlp, masks, mode=mode)["rho"])
    return out


def _first_three_below(rho, threshold=0.2):
    """The rule, written out: the first index ending 3 results in a row below the threshold."""
    return next(
        (i for i in range(2, len(rho)) if all(r < threshold for r in rho[i - 2 : i + 1])), None
    )


def test_analyze_names_the_rollout_where_it_first_fired_and_the_rho(tmp_path, capsys):
    d = _dumps(tmp_path / "train_data", COLLAPSE)
    product, geometric = _rho(COLLAPSE, "product"), _rho(COLLAPSE, "geometric")
    first = _first_three_below(product)
    assert first == 6 and _first_three_below(geometric) is None  # a real difference
    out = tmp_path / "out"
    assert main(["analyze", str(d), "--out", str(out), "--no-figure", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    streak = ", ".join(f"{r:.3g}" for r in product[4:7])
    line = (
        f"product weights: EARLY WARNING first at rollout 6, rho {product[6]:.3g} (rho below "
        f"0.2 for 3 rollouts in a row: {streak}"
    )
    assert line in printed
    assert "ESS collapses before training does" in printed and "--use-ess-lr" in printed
    low = min(range(len(geometric)), key=geometric.__getitem__)
    assert (
        f"geometric weights: no early warning (rho below 0.2 for 3 rollouts in a row: never; "
        f"lowest rho {geometric[low]:.3g} at rollout {low})"
    ) in printed
    summary = (out / "summary.md").read_text()
    assert "## Early warning (ESS collapse)" in summary and line in summary


def test_the_rule_settings_and_a_second_episode(tmp_path):
    d = _dumps(tmp_path / "train_data", COLLAPSE)
    product = _rho(COLLAPSE, "product")
    # patience 1: each drop below 0.2 after one rollout at or above it is a new episode
    result = analyze([d], tmp_path / "out", figure=False, warn_patience=1)
    [warning] = [w for w in result.warnings if w.weight_mode == "product"]
    expected = [i for i, r in enumerate(product) if r < 0.2 and (i == 0 or product[i - 1] >= 0.2)]
    assert list(warning.fired) == expected == [4, 8]
    assert "2 episodes, at rollouts [4, 8]" in warning.text()
    quiet = analyze([d], tmp_path / "out2", figure=False, warn_threshold=0.0)
    assert quiet.warnings == []
    assert "Early warning" not in (tmp_path / "out2" / "summary.md").read_text()


def test_a_steady_run_has_no_warning(tmp_path):
    d = _dumps(tmp_path / "train_data", SIGMAS)
    result = analyze([d], tmp_path / "out", figure=False)
    assert [w.fired for w in result.warnings] == [(), ()]
    assert all("no early warning" in w.text() for w in result.warnings)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--warn-threshold", "1.5", "threshold 1.5 must be in"),
        ("--warn-patience", "0", "patience 0"),
    ],
)
def test_bad_warning_settings_exit_2_and_write_nothing(tmp_path, capsys, option, value, message):
    d = _dumps(tmp_path / "train_data", SIGMAS)
    out = tmp_path / "out"
    assert main(["analyze", str(d), "--out", str(out), option, value]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
