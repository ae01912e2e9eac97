"""Kernel modules import nothing above them: rlkernels/kernels/ may use torch, triton and its own
package, never rlkernels.backends / api / config (launch tables live with their launchers)."""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "rlkernels" / "kernels"


def test_kernel_modules_do_not_import_upward():
    offenders = []
    for path in KERNELS.rglob("*.py"):
        package_depth = len(path.relative_to(KERNELS).parts)  # kernels/triton/x.py -> 2
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                upward = node.level > package_depth or (node.level == 0 and (node.module or "").startswith("rlkernels")
                                                          and not (node.module or "").startswith("rlkernels.kernels"))
                if upward:
                    offenders.append(f"{path.name}: from {'.' * node.level}{node.module or ''} import ...")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.name}: import {a.name}" for a in node.names
                              if a.name.startswith("rlkernels") and not a.name.startswith("rlkernels.kernels")]
    assert not offenders, offenders
