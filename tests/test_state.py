"""The state holder: one object, each owner's fields in a part of its own, reset by the part."""

from __future__ import annotations

import weakref
from dataclasses import fields

from ess_patch import state
from ess_patch.state import STATE, reset


def test_every_field_belongs_to_one_owner_part():
    owners: dict[str, list[str]] = {}
    for part in state._PARTS:
        for f in fields(part):
            owners.setdefault(f.name, []).append(part.__name__)
    assert {f.name for f in fields(type(STATE))} == set(owners)
    assert {name: parts for name, parts in owners.items() if len(parts) > 1} == {}


def test_reset_puts_every_part_back_but_what_install_set_up():
    kept = {name for part in state._PARTS for name in part.keep}
    assert kept == {"config", "step_wrappers", "step_guard"}
    before = {f.name: getattr(STATE, f.name) for f in fields(type(STATE))}
    try:
        marks = {}
        for f in fields(type(STATE)):
            if f.name not in ("caches", "local", "excluded"):
                marks[f.name] = object()
                setattr(STATE, f.name, marks[f.name])
        STATE.local.in_step = True
        reset()
        fresh = type(STATE)()
        for f in fields(type(STATE)):
            if f.name in kept:
                assert getattr(STATE, f.name) is marks[f.name], f.name
            elif f.name not in ("caches", "local", "excluded"):
                assert getattr(STATE, f.name) == getattr(fresh, f.name), f.name
        assert not getattr(STATE.local, "in_step", False)
        assert isinstance(STATE.excluded, weakref.WeakSet) and len(STATE.excluded) == 0
    finally:
        for name, value in before.items():
            setattr(STATE, name, value)
