"""Every public name removed since 0.1.0 says what replaces it, however it is reached, and the
changelog lists each with its replacement.

The independent expectation is 0.1.0's own ``__all__`` (read from git history, 794abf9,
written out below): every name in it is still exported, or is a removed name with a
replacement.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import ess_patch
from ess_patch.removed import (
    REMOVED_KEYWORDS,
    REMOVED_NAMES,
    RemovedImportError,
    RemovedKeywordError,
    RemovedNameError,
)

ROOT = Path(__file__).resolve().parents[1]

#: ``ess_patch.__all__`` at 794abf9, the last commit of 0.1.0
ALL_0_1_0 = {
    "ConfigMismatchError",
    "EssLrConfig",
    "EssLrResult",
    "InvalidInputsElsewhereError",
    "MissingTargetError",
    "NonFiniteLogProbError",
    "StepCountError",
    "__version__",
    "arm",
    "arm_steps",
    "armed",
    "armed_steps",
    "attach",
    "broadcast_from_last_stage",
    "broadcast_steps_from_last_stage",
    "compute_ess_lr",
    "compute_ess_lr_steps",
    "detach",
    "disarm",
    "exclude",
    "install",
    "installed_targets",
    "is_installed",
    "scaled_lr",
    "set_role",
    "uninstall",
}


def _inputs():
    return [torch.zeros(2)], [torch.zeros(2)], [torch.ones(2)]


def test_every_0_1_0_name_is_exported_or_removed_with_a_replacement():
    gone = ALL_0_1_0 - set(ess_patch.__all__)
    assert gone == set(REMOVED_NAMES)
    for name in ALL_0_1_0 & set(ess_patch.__all__):
        assert getattr(ess_patch, name) is not None


@pytest.mark.parametrize("name", sorted(REMOVED_NAMES))
def test_attribute_access_names_the_replacement(name):
    release, instead = REMOVED_NAMES[name]
    with pytest.raises(RemovedNameError) as caught:
        getattr(ess_patch, name)
    message = str(caught.value)
    assert f"ess_patch.{name} was removed in ess-patch {release}" in message
    assert instead in message and "CHANGELOG.md" in message
    assert isinstance(caught.value, AttributeError)  # hasattr and getattr(default) still work
    assert not hasattr(ess_patch, name)
    assert getattr(ess_patch, name, "absent") == "absent"


@pytest.mark.parametrize("name", sorted(REMOVED_NAMES))
def test_from_import_names_the_replacement(name):
    """Python turns an AttributeError into a bare 'cannot import name': ours is an ImportError
    that keeps the message, at module level and inside a function."""
    for code in (
        f"from ess_patch import {name}",
        f"def f():\n    from ess_patch import arm, {name}\nf()",
    ):
        with pytest.raises(RemovedImportError) as caught:
            exec(compile(code, "<snippet>", "exec"), {})
        assert isinstance(caught.value, ImportError)
        assert REMOVED_NAMES[name][1] in str(caught.value)
        assert caught.value.name == name


def test_a_name_that_never_existed_stays_a_plain_error():
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'") as caught:
        exec("from ess_patch import no_such_name", {})
    assert not isinstance(caught.value, RemovedImportError)
    with pytest.raises(AttributeError) as caught:
        ess_patch.no_such_name  # noqa: B018
    assert not isinstance(caught.value, RemovedNameError)


def test_prepare_masks_names_error_and_what_to_do(clean_ess):
    with pytest.raises(RemovedKeywordError) as caught:
        ess_patch.compute_ess_lr(*_inputs(), prepare_masks=lambda masks: masks)
    message = str(caught.value)
    assert isinstance(caught.value, TypeError)
    assert "compute_ess_lr() no longer takes prepare_masks=" in message
    assert "error=exc" in message and "CHANGELOG.md" in message
    assert ess_patch.armed() is None  # nothing armed, nothing computed


def test_an_unknown_keyword_is_the_usual_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'cp_gruop'") as caught:
        ess_patch.compute_ess_lr(*_inputs(), cp_gruop=None)
    assert not isinstance(caught.value, RemovedKeywordError)


def test_the_changelog_lists_each_removed_name_with_its_replacement():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    removed = text.split("### Removed", 1)[1].split("\n## ", 1)[0]
    row = re.compile(r"^\| `(?:ess_patch\.)?(\w+)\((?!\.\.\.).*?\)` \| (.+) \|$", re.M)
    rows = {m.group(1): m.group(2) for m in row.finditer(removed)}
    rows.update(
        {
            kw: instead
            for (fn, kw) in REMOVED_KEYWORDS
            for line in removed.splitlines()
            if f"`{fn}(..., {kw}=" in line
            for instead in [line.rsplit("|", 2)[1]]
        }
    )
    expected = set(REMOVED_NAMES) | {kw for _, kw in REMOVED_KEYWORDS}
    assert set(rows) == expected
    for name, instead in rows.items():
        assert "ess_patch." in instead or "compute_ess_lr" in instead, name
