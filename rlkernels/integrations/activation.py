"""How an adapter reaches the processes a trainer starts.

An adapter's `install()` rebinds names in the trainer's modules. Called in the user's script it reaches that process
only, and most trainers run their actor elsewhere: OpenRLHF in `@ray.remote` actors, AReaL in RPC workers its
scheduler launches (`python -m areal.infra.rpc.rpc_server`), SkyRL, slime and NeMo-RL in Ray actors. Each of those
imports the trainer afresh. Two ways in, each one line on the trainer's command line or config:

- Ray: the job's `runtime_env={"worker_process_setup_hook": "rlkernels.integrations.<trainer>.install"}`
  (`ray.init(runtime_env=...)`, or `ray job submit --runtime-env-json '{...}'`, which Ray merges with the
  runtime_env the trainer's own `ray.init` passes). Ray calls it in every worker process as the process starts.
  It is a job-level field: Ray ignores it in an actor's `.options(runtime_env=...)`.
- a launched worker: `python -m rlkernels.integrations.launch <trainer> <module> [args...]` in place of
  `python -m <module> [args...]` (AReaL: `scheduling_spec.cmd`), which installs, then runs the module as `__main__`.

So `install()` runs in processes that may never import the trainer (a rollout engine, a reward worker): it imports
none of the trainer. `when_imported` applies the patch to a trainer module that is already imported, and otherwise
the moment the module is first imported, before any other module can bind the names it defines; `Rebinding` is
one such name across a trainer's modules, with the way back.
"""

import importlib.abc
import sys
import threading
from typing import Callable, Dict, List, Optional

_PENDING: Dict[str, List[Callable]] = {}
_LOCK = threading.Lock()


class _PatchAfterExec(importlib.abc.Loader):
    """The module's own loader, then the patches waiting for it, taken only once the module has executed (a spec
    looked up but not loaded, or an import that raised, leaves them waiting). Every other attribute is the original
    loader's, so resource reads and `inspect.getsource` behave as without it."""

    def __init__(self, loader, name):
        self._loader, self._name = loader, name

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _LOCK:
            patches = _PENDING.pop(self._name, [])
        for patch in patches:
            patch(module)


class _WatchImports(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the finders after it and wraps the loader they return (a
    namespace package's, which executes nothing, is not wrapped: its patches wait for a module that does)."""

    def find_spec(self, fullname, path=None, target=None):
        with _LOCK:
            if fullname not in _PENDING:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module") and spec.origin is not None:
                    spec.loader = _PatchAfterExec(spec.loader, fullname)
                return spec
        return None


_WATCHER = _WatchImports()


def when_imported(module_name: str, patch: Callable) -> None:
    """Call `patch(module)` on `module_name` now if it is imported, else right after its first import executes.
    The watch ends when it fires: a module deleted from `sys.modules` and imported again, or reloaded, is not patched
    again. (A module still executing when this is called, in a circular import, is patched as it is then.) A patch
    already waiting for the module (equal to it) is not added twice."""
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
        return
    with _LOCK:
        waiting = _PENDING.setdefault(module_name, [])
        if patch not in waiting:  # an install() called again (a loss object built or unpickled once per step)
            waiting.append(patch)
        if _WATCHER not in sys.meta_path:
            sys.meta_path.insert(0, _WATCHER)


def cancel(module_name: str, patch: Optional[Callable] = None) -> None:
    """Drop `patch` (every patch, when None) still waiting for `module_name` (an `uninstall()` before the trainer
    was imported); the other patches on that module keep waiting."""
    with _LOCK:
        waiting = _PENDING.get(module_name, [])
        kept = [] if patch is None else [p for p in waiting if p != patch]
        if kept:
            _PENDING[module_name] = kept
        else:
            _PENDING.pop(module_name, None)


class Rebinding:
    """A name in some of a trainer's modules rebound to rlkernels' object, and put back.

    `attribute` is the name in each module (or a dotted path into it: "Actor.forward"). `install()` patches every
    module of `modules` now or when it is imported; a module that lacks the name is left alone. `uninstall()` puts
    the trainer's object back in every module that holds rlkernels' one, whether the patch set it there or the
    module imported it from one already patched (`from .loss import PolicyLoss` after `loss` was patched)."""

    def __init__(self, attribute: str, ours, modules):
        self.attribute, self.ours, self.modules = attribute, ours, tuple(modules)
        self.original = None  # the trainer's object the first patch replaced (OpenRLHF's forward delegates to it)
        self._holders = {}  # id -> (module, the object it held before): those patched or found holding ours

    def install(self) -> None:
        for name in self.modules:
            when_imported(name, self.patch)

    def uninstall(self) -> None:
        for name in self.modules:
            cancel(name, self.patch)
        for module, before in self._holders.values():
            restored = before if before is not None else self.original
            if restored is not None and self._get(module) is self.ours:
                self._set(module, restored)
        self._holders.clear()
        self.original = None

    def patch(self, module) -> None:
        """Rebind the name in `module` (any module object) if it has it."""
        current = self._get(module)
        if current is None:
            return
        before = None
        if current is not self.ours:
            before = current
            if self.original is None:
                self.original = current
            self._set(module, self.ours)
        held = self._holders.get(id(module))
        self._holders[id(module)] = (module, before if before is not None or held is None else held[1])

    def _owner(self, module):
        *path, _ = self.attribute.split(".")
        for part in path:
            module = getattr(module, part, None)
        return module

    def _get(self, module):
        owner = self._owner(module)
        return None if owner is None else getattr(owner, self.attribute.rsplit(".", 1)[-1], None)

    def _set(self, module, value) -> None:
        setattr(self._owner(module), self.attribute.rsplit(".", 1)[-1], value)
