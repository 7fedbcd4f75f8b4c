"""The tests' fresh-interpreter runner (tests/fresh.py): results through a file, the child's
own error on failure."""

from __future__ import annotations

import os

import pytest
from fresh import FreshPythonError


def test_the_result_comes_back_through_emit_and_stdout_is_left_alone(fresh_python, tmp_path):
    code = """
        import sys
        print("RESULT not parsed")
        emit({"argv": sys.argv[1:], "first": sys.path[0], "name": __name__, "x": object})
    """
    fresh = fresh_python(code, args=["--flag", "v"], cwd=tmp_path)
    assert fresh.result["argv"] == ["--flag", "v"]
    assert fresh.result["first"] in ("", str(tmp_path))  # like ``python -c``: cwd first
    assert fresh.result["name"] == "__main__"
    assert fresh.result["x"] == repr(object)  # what JSON cannot hold comes back as repr
    assert fresh.stdout == "RESULT not parsed\n"


def test_the_environment_is_the_one_given(fresh_python):
    env = {**os.environ, "FRESH_TEST_VALUE": "42"}
    assert fresh_python("import os; emit(os.environ['FRESH_TEST_VALUE'])", env).result == "42"
    assert fresh_python("import os; emit('FRESH_TEST_VALUE' in os.environ)").result is False


def test_a_failing_child_raises_with_its_own_traceback(fresh_python):
    code = """
        def inner():
            raise ValueError("the child's own words")
        inner()
    """
    with pytest.raises(FreshPythonError) as info:
        fresh_python(code)
    message = str(info.value)
    assert "exited with 1" in message
    assert "ValueError: the child's own words" in message
    assert ", line 3, in inner" in message  # the snippet's own line numbers


def test_a_child_that_never_emits_raises(fresh_python):
    with pytest.raises(FreshPythonError, match="without calling emit"):
        fresh_python("import sys; print('done', file=sys.stderr)")
    assert fresh_python("print('done')", emits=False).result is None


def test_a_hung_child_is_killed_and_raises(fresh_python):
    with pytest.raises(FreshPythonError, match=r"timed out after 1s[\s\S]*started"):
        fresh_python(
            "import sys, time; print('started', file=sys.stderr, flush=True); time.sleep(60)",
            timeout=1,
        )


def test_the_boot_code_imports_nothing_of_ours(fresh_python):
    fresh = fresh_python("import sys; emit(sorted(sys.modules))")
    assert "ess_patch" not in fresh.result and "torch" not in fresh.result
