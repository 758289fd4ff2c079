"""The suite's own rule: a test never skips (a missing tool or build is a failure that says how to get it) and is
never expected to fail. Checked on the test sources, so a new skip cannot slip in."""

from __future__ import annotations

import ast

from .conftest import TESTS

# pytest.skip(...), pytest.importorskip(...), pytest.xfail(...), @pytest.mark.skip/skipif/xfail
_FORBIDDEN = {"skip", "importorskip", "xfail", "skipif"}


def _uses(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _FORBIDDEN:
            base = node.value
            # pytest.skip / pytest.mark.skipif / mark.xfail (however pytest was imported)
            names = []
            while isinstance(base, ast.Attribute):
                names.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name):
                names.append(base.id)
            if {"pytest", "mark"} & set(names):
                found.append((node.lineno, ".".join(reversed(names)) + "." + node.attr))
    return found


def test_no_test_skips_or_expects_to_fail():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for line, what in _uses(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(TESTS)}:{line}: {what}")
    assert offenders == [], "the suite never skips: make it a real check, or a failure with the fix\n" + "\n".join(offenders)


def test_the_rule_sees_each_form():
    src = ("import pytest\nfrom pytest import mark\n"
           "@pytest.mark.skipif(True, reason='x')\ndef test_a(): pytest.skip('x')\n"
           "@mark.xfail\ndef test_b(): pytest.importorskip('y')\n")
    assert sorted(_uses(ast.parse(src))) == [
        (3, "pytest.mark.skipif"), (4, "pytest.skip"), (5, "mark.xfail"), (6, "pytest.importorskip")]
