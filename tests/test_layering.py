"""The package's layers and seams, checked on the source (docs/development.md, "Layout").

- Each layer imports only the layers below it (module-level and function-level imports alike):
  kernels (nothing of rlkernels) < backends < ops; the stage stands apart from the passes (it may ask
  `backends` whether Triton exists, to decide whether to compile itself); config reads the stage's loss
  table; inputs and api sit on top; integrations use the public layer; reference imports nothing else.
- No function outside kernels/, backends/, reference/ and testing/ takes more than 8 parameters, except the
  public entry points, torch.library op schemas (and their fake implementations) and autograd forward/backward.
- No function body is over 80 lines without a comment that starts "# Long on purpose" and says why.
- api.py is thin: it raises nothing (every check is in inputs), and each public function's body, past its
  docstring, is at most API_BODY_LINES lines (its arguments to inputs, one call of step or the stage).
- The newcomer's map stays true: every module under rlkernels/ is named in docs/development.md's layout.
- The front page stays one: README.md has at most README_LINES lines (the detail has its page under docs/).
"""

import ast
import inspect
import re
from pathlib import Path

import rlkernels

ROOT = Path(__file__).resolve().parents[1] / "rlkernels"

# layer -> the rlkernels layers it may import (its own always)
ALLOWED = {
    "kernels": set(),
    "backends": {"kernels", "_C"},  # _C: the compiled CUDA extension
    "ops": {"backends"},
    "stage": {"backends"},
    "reference": set(),
    "config": {"stage", "integrations"},  # the loss table; the trainer constructors delegate to integrations
    "outputs": set(),  # the public result types
    "inputs": {"config", "stage", "ops", "backends", "outputs"},
    "step": {"config", "stage", "ops", "backends", "inputs", "outputs"},
    "api": {"config", "stage", "ops", "backends", "inputs", "outputs", "step", "notices"},
    "notices": set(),  # warnings read from device values without a sync
    "integrations": {"api", "config", "integrations"},
    "schedules": set(),
    # helpers for tests and benchmarks (the trainers' releases from integrations)
    "testing": {"api", "config", "stage", "inputs", "outputs", "ops", "backends", "integrations"},
    "__init__": {"api", "config", "outputs", "schedules"},
    "demo": {"__init__", "api", "config", "backends"},
}
# the public entry points (their keyword arguments are the API: exempt from the seam count), and the functions whose
# signature is a peer's (verl's advantage-estimator call, AReaL's loss function, OpenRLHF's PolicyLoss constructor and
# Actor.forward)
PUBLIC = {name for name in rlkernels.__all__ if inspect.isfunction(getattr(rlkernels, name))}
PEER_SIGNATURES = {"compute_rlkernels_optimal_token_baseline", "ppo_actor_loss_fn", "PolicyLoss.__init__",
                   "actor_forward"}
LONG_LINES = 80
API_BODY_LINES = 10
README_LINES = 160
REPO = ROOT.parent


def _layer(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def _type_checking_only(tree):
    """Nodes under `if TYPE_CHECKING:` (imports for annotations only, never executed)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return skipped


def _module_layer(name: str) -> str:
    """The layer of `rlkernels.<name>`: a subpackage or module, else a name of the package root."""
    return name if (ROOT / name).is_dir() or (ROOT / f"{name}.py").exists() or name == "_C" else "__init__"


def _imported_layers(path: Path, tree):
    """(line, layer) of every rlkernels module this file imports."""
    package = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]  # e.g. ("rlkernels", "stage")
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = list(base) + (node.module.split(".") if node.module else [])
            elif (node.module or "").startswith("rlkernels"):
                target = node.module.split(".")
            else:
                continue
            names = [target[1]] if len(target) > 1 else [a.name for a in node.names]
            for name in names:
                yield node.lineno, _module_layer(name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rlkernels."):
                    yield node.lineno, alias.name.split(".")[1]


def _sources():
    for path in sorted(ROOT.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_each_layer_imports_only_the_layers_below_it():
    offenders = []
    for path, tree in _sources():
        layer = _layer(path)
        for line, imported in _imported_layers(path, tree):
            if imported != layer and imported not in ALLOWED[layer]:
                offenders.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {imported}")
    assert not offenders, "\n".join(offenders)


def _exempt_from_parameter_count(node, parents) -> bool:
    decorators = [ast.unparse(d) for d in node.decorator_list]
    if any("custom_op" in d or "register_fake" in d or d.endswith(".register_fake") for d in decorators):
        return True
    if node.name in ("forward", "backward") and any(isinstance(p, ast.ClassDef) for p in parents):
        return True  # torch.autograd.Function
    qualified = ".".join([p.name for p in parents if isinstance(p, ast.ClassDef)] + [node.name])
    return (node.name in PUBLIC and not parents) or qualified in PEER_SIGNATURES


def _functions(tree):
    """(function node, enclosing nodes) of every def in the module."""
    stack = [(tree, [])]
    while stack:
        node, parents = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield child, parents
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stack.append((child, parents + [child]))


def test_seams_take_at_most_eight_parameters():
    offenders = []
    for path, tree in _sources():
        if _layer(path) in ("kernels", "backends", "reference", "testing"):
            continue  # launchers, the oracle's formulas and test helpers take their tensors loose, by design
        for fn, parents in _functions(tree):
            a = fn.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            n -= bool(a.args) and a.args[0].arg in ("self", "cls", "ctx")
            if n > 8 and not _exempt_from_parameter_count(fn, parents):
                offenders.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} takes {n}")
    assert not offenders, "\n".join(offenders)


def test_long_functions_say_why():
    offenders = []
    for path, tree in _sources():
        lines = path.read_text().splitlines()
        for fn, _ in _functions(tree):
            body = lines[fn.lineno - 1:fn.end_lineno]
            if len(body) > LONG_LINES and not any(line.strip().startswith("# Long on purpose") for line in body):
                offenders.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({len(body)} lines)")
    assert not offenders, "\n".join(offenders)


def test_the_checks_see_the_package():
    """The walks above found the layers and the seams they check (a wrong root would pass them all)."""
    layers = {_layer(p) for p, _ in _sources()}
    assert {"kernels", "backends", "ops", "stage", "reference", "inputs", "api", "integrations"} <= layers
    assert sum(1 for p, t in _sources() for _ in _functions(t)) > 200


def test_api_raises_nothing_and_its_functions_stay_thin():
    path = ROOT / "api.py"
    tree = ast.parse(path.read_text())
    raises = [f"api.py:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Raise)]
    assert not raises, f"api.py raises (checks belong in rlkernels/inputs): {raises}"
    public = [n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    assert {n.name for n in public} == PUBLIC, "api.py's public functions are rlkernels' public functions"
    fat = {}
    for fn in public:
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body  # past the docstring
        lines = body[-1].end_lineno - body[0].lineno + 1
        if lines > API_BODY_LINES:
            fat[fn.name] = lines
    assert not fat, f"api.py functions over {API_BODY_LINES} lines past the docstring: {fat}"
    assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name.startswith("_")], \
        "api.py holds private helpers (their room is step, inputs or the stage)"


def _layout_block() -> str:
    text = (REPO / "docs" / "development.md").read_text()
    section = text[text.index("## Layout"):]
    return section[section.index("```"):section.index("```", section.index("```") + 3)]


def test_every_module_is_named_in_the_development_map():
    """Each module appears in the layout under its folder: by its file name, or (for a list of several) in a
    line of the folder's entry; a package by its folder name."""
    block = _layout_block()
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        name = rel.parent.name + "/" if rel.name == "__init__.py" else rel.name
        if rel == Path("__init__.py"):
            continue
        if not re.search(rf"(?<![\w/]){re.escape(name)}", block):
            missing.append(str(rel))
    assert not missing, f"modules not named in docs/development.md's layout: {missing}"


def test_readme_stays_a_front_page():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines (at most {README_LINES}): move the detail to docs/"
