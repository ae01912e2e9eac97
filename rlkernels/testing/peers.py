"""The peers' own code, importable on a CPU machine without their whole stacks, and the examples' tiny
models (in a checkout: examples/ beside the package): shared by the tests (tests/peers, tests/integrations) and
the benchmarks.

verl imports ray (and, in places, transformers) at module level, but its loss functions, driver-side
rollout correction and FSDP engine code need neither on a CPU. `inert_ray_transformers` stands in for the
missing ones while verl imports, and only then.
"""

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types


class _InertModule(types.ModuleType):
    """Stands in for `ray` / `transformers` while verl imports; any attribute is another inert module."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _InertModule(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = ("ray", "transformers")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def inert_ray_transformers():
    """verl imports ray and transformers at module level but the loss functions need neither.

    Placeholders are installed only if the real packages are missing, and removed afterwards (Liger
    probes `transformers` and takes a wrong branch if it finds a fake one)."""
    missing = [r for r in _InertFinder.ROOTS if importlib.util.find_spec(r) is None]
    finder = _InertFinder()
    if missing:
        _InertFinder.ROOTS = tuple(missing)
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if missing:
            sys.meta_path.remove(finder)
            for key in list(sys.modules):
                if key.split(".")[0] in missing and isinstance(sys.modules[key], _InertModule):
                    del sys.modules[key]


_VERL = None
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def load_example(filename: str):
    """examples/<filename> as a module (the examples are scripts, not a package): their tiny models and
    batches serve the tests and benchmarks too."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(filename)[0] + "_example",
                                                  os.path.join(EXAMPLES, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_verl():
    """(rollout_corr_helper, core_algos, ActorConfig) or raises ImportError."""
    global _VERL
    if _VERL is None:
        with inert_ray_transformers():
            from verl.trainer.ppo import core_algos, rollout_corr_helper
            from verl.workers.config import ActorConfig
        _VERL = (rollout_corr_helper, core_algos, ActorConfig)
    return _VERL


def verl_source_function(module: str, name: str, namespace: dict):
    """Function `name` of a verl module whose import this machine cannot afford (verl's trainer module pulls in
    its rollout servers), compiled from verl's own source text with the names it uses given in `namespace`."""
    import ast

    spec = importlib.util.find_spec(module)
    tree = ast.parse(open(spec.origin).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = dict(namespace)
    exec(compile(ast.Module(body=[node], type_ignores=[]), spec.origin, "exec"), scope)
    return scope[name]
