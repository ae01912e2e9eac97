"""The suite's own rule, checked on its source: every numeric tolerance is an entry of tests/cases.py's TOL table,
with its reason.

No test file under tests/ but cases.py passes rtol= / atol= / rel= / abs= a number other than 0 (nor a number in
those positions of allclose / isclose / approx, nor gives such a parameter a numeric default), and none assigns a
module-level name containing TOL: a test that
needs a bound adds an entry to cases.TOL and reads it through tol(), approx() or at_most(). Exact comparisons stay
exact (torch.equal, or rtol = atol = 0) and pass.
"""

import ast
import operator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TABLE = "cases.py"  # the one file that writes tolerances
KEYWORDS = {"rtol", "atol", "rel", "abs"}
# positional tolerances: the index of the first one in calls of these names (allclose(a, b, rtol, atol))
POSITIONAL = {"allclose": 2, "isclose": 2, "approx": 1}
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.Pow: operator.pow}


def _number(node):
    """The value of an expression of numeric literals only (1e-5, -2.0**-7, 2 * 1e-6), else None."""
    if isinstance(node, ast.Constant):
        value = node.value
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _number(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _number(node.left), _number(node.right)
        if left is None or right is None:
            return None
        try:
            return _ARITHMETIC[type(node.op)](left, right)
        except (ArithmeticError, ValueError):
            return float("nan")  # a number all the same
    return None


def _module_statements(body):
    """The module's own statements, through if / try / with / for blocks (not into functions or classes)."""
    for node in body:
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _module_statements(getattr(node, field, []))


def inline_tolerances(source: str):
    """(line, what) for each numeric tolerance written in `source`."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in KEYWORDS:
            value = _number(node.value)
            if value is not None and value != 0:
                found.append((node.value.lineno, f"{node.arg}={ast.unparse(node.value)}"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):  # def close(a, b, rtol=1e-5)
            a = node.args
            params = list(zip((a.posonlyargs + a.args)[len(a.posonlyargs + a.args) - len(a.defaults):], a.defaults))
            params += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, default in params:
                value = _number(default) if arg.arg in KEYWORDS else None
                if value is not None and value != 0:
                    found.append((default.lineno, f"{arg.arg}={ast.unparse(default)}"))
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = POSITIONAL.get(func)
            for arg in node.args[first:] if first is not None else ():
                value = _number(arg)
                if value is not None and value != 0:
                    found.append((arg.lineno, f"{func}(..., {ast.unparse(arg)})"))
    for node in _module_statements(tree.body):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name) and "TOL" in name.id.upper():
                    found.append((node.lineno, f"module-level {name.id}"))
    return sorted(found)


def offenders(root: Path):
    """'path:line what' for every inline tolerance in the test files under `root` (its cases.py excepted)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) == Path(TABLE):
            continue
        for line, what in inline_tolerances(path.read_text()):
            out.append(f"{path.relative_to(root)}:{line} {what}")
    return out


def test_no_test_file_writes_a_tolerance_inline():
    found = offenders(TESTS)
    assert not found, ("numeric tolerances outside tests/cases.py (add a TOL entry with its reason and read it "
                       "through tol() / approx() / at_most()):\n" + "\n".join(found))


VIOLATIONS = '''
import pytest, torch
B, TOL = 8, 1e-5
STATS_RTOL, STATS_ATOL = 1e-4, 1e-5
if True:
    GRAD_TOL: float = 2.0**-7

def close(a, b, what, rtol=1e-5, *, atol=1e-6):
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert x == pytest.approx(y, rel=1e-4, abs=1e-5)
    assert_close(a, b, rtol=-2.0**-7 * 2, atol=0)
    assert torch.allclose(a, b, 1e-5)
    assert x == pytest.approx(y, 1e-6)
'''
EXACT = '''
import pytest, torch
from .cases import TOL, approx, tol
B = 8

def test_b(rtol=0, atol=None):
    tol_here = 1e-5  # a local name: not the module's
    assert_close(a, b, rtol=0, atol=0.0)
    assert x == pytest.approx(y, rel=0, abs=-0.0)
    assert torch.equal(a, b) and abs(x) <= bound
    assert_close(a, b, **tol("value", F32), name="loss")
    assert_close(a, b, rtol=TOL["divergence", F32].rtol, atol=float(scale))
    assert x == approx(y, "by_hand") and torch.allclose(a, b, **BOUND)
'''


def test_the_guard_flags_inline_tolerances_and_passes_exact_comparisons(tmp_path):
    assert inline_tolerances(VIOLATIONS) == [
        (3, "module-level TOL"), (4, "module-level STATS_ATOL"), (4, "module-level STATS_RTOL"),
        (6, "module-level GRAD_TOL"), (8, "atol=1e-06"), (8, "rtol=1e-05"), (9, "atol=1e-12"), (9, "rtol=1e-12"),
        (10, "abs=1e-05"), (10, "rel=0.0001"), (11, "rtol=-2.0 ** (-7) * 2"), (12, "allclose(..., 1e-05)"),
        (13, "approx(..., 1e-06)")]
    assert inline_tolerances(EXACT) == []
    # on a scratch copy of the suite's layout: a test file with one violation fails, the table itself does not
    (tmp_path / "stage").mkdir()
    (tmp_path / TABLE).write_text("TOL = {('value', 'f32'): (2e-5, 1e-5)}\nprint(tol(rtol=1e-5))\n")
    (tmp_path / "stage" / "test_x.py").write_text(EXACT + "\n\ndef test_c():\n    assert torch.allclose(a, b, "
                                                  "rtol=1e-6, atol=0)\n")
    assert offenders(tmp_path) == [f"{Path('stage', 'test_x.py')}:17 rtol=1e-06"]


def test_the_guard_reads_the_suite():
    """The walk finds the test files, and would flag the table itself (a wrong root or a blind parser would pass)."""
    assert sum(1 for _ in TESTS.rglob("test_*.py")) > 50
    assert any(what == "module-level TOL" for _, what in inline_tolerances((TESTS / TABLE).read_text()))


def test_the_op_recorder_sees_atomic_ops_and_their_dtypes():
    """aten_ops (the determinism tests' recorder) sees an in-place index_add_ and a scatter_add, with the dtype they
    act on: the atomic-op checks can fail."""
    import torch

    from .cases import ATOMIC_OPS, aten_ops

    def accumulate(x, i):
        return torch.zeros(3).index_add_(0, i, x), torch.zeros(3, dtype=torch.long).scatter_add(0, i, i)

    ops = aten_ops(accumulate, torch.ones(2), torch.tensor([0, 2]))
    assert {"index_add_", "scatter_add"} <= set(ops) & ATOMIC_OPS
    assert ops["index_add_"] == {torch.float32} and ops["scatter_add"] == {torch.long}
