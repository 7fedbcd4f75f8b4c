"""install() / uninstall() from several threads at once (issue 24).

Without one lock around the lifecycle, two threads could both see "not installed", both
wrap, and one record overwrite the other: every target wrapped while ``installed_targets()``
was empty and ``uninstall()`` removed nothing. Each round starts N threads on one barrier so
that their calls overlap; the thread switch interval is made tiny to interleave them.
"""

from __future__ import annotations

import sys
import threading

import pytest

import ess_patch
from ess_patch.patching import is_ours

THREADS = 8
ROUNDS = 10


def _megatron_steps() -> dict[str, object]:
    import megatron.core.optimizer.optimizer as m

    return {
        f"{name}.{attr}": vars(klass).get(attr)
        for name, klass in vars(m).items()
        if isinstance(klass, type) and klass.__module__ == m.__name__
        for attr in ("step", "step_with_ready_grads")
        if attr in vars(klass)
    }


def _all_at_once(fn, threads: int = THREADS) -> list[BaseException]:
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run():
        barrier.wait()
        try:
            fn()
        except BaseException as exc:  # collected: asserted empty by the caller
            errors.append(exc)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers), "a thread is stuck (deadlock?)"
    return errors


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def test_concurrent_install_and_uninstall_keep_one_consistent_record(clean_ess, fast_switching):
    import megatron.core.optimizer.optimizer  # noqa: F401  # wrapped at install, not later

    originals = _megatron_steps()
    assert originals and not any(is_ours(f) for f in originals.values())
    for _ in range(ROUNDS):
        assert _all_at_once(lambda: ess_patch.install("megatron")) == []
        assert ess_patch.is_installed()
        targets = ess_patch.installed_targets()
        wrapped = [path for path, f in _megatron_steps().items() if is_ours(f)]
        # every wrapped attribute is recorded, once: uninstall can remove all of them
        assert wrapped and len(targets) == len(set(targets))
        assert {t.split(".", 4)[-1] for t in targets} >= set(wrapped), (targets, wrapped)
        assert _all_at_once(ess_patch.uninstall) == []
        assert not ess_patch.is_installed() and ess_patch.installed_targets() == []
        now = _megatron_steps()
        assert all(now[k] is originals[k] for k in originals), "an original was not put back"


def test_install_racing_uninstall_ends_in_one_of_the_two_states(clean_ess, fast_switching):
    import megatron.core.optimizer.optimizer  # noqa: F401

    originals = _megatron_steps()
    ess_patch.install("megatron")  # what one plain install wraps
    expected = {k for k, f in _megatron_steps().items() if is_ours(f)}
    ess_patch.uninstall()
    for i in range(ROUNDS):
        calls = [lambda: ess_patch.install("megatron"), ess_patch.uninstall] * (THREADS // 2)
        order = iter(calls[i % 2 :] + calls[: i % 2])
        lock = threading.Lock()

        def next_call(order=order, lock=lock):
            with lock:
                call = next(order)
            call()

        assert _all_at_once(next_call) == []
        wrapped = {k for k, f in _megatron_steps().items() if is_ours(f)}
        if ess_patch.is_installed():
            assert wrapped == expected  # installed: everything wrapped and recorded
            assert len(ess_patch.installed_targets()) >= len(expected)
        else:
            assert wrapped == set() and ess_patch.installed_targets() == []
        if ess_patch.is_installed():
            ess_patch.uninstall()
        assert all(v is originals[k] for k, v in _megatron_steps().items())
