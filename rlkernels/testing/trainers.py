"""Four RL trainers' own loss code, importable on a CPU machine for parity tests: SkyRL 0.4.0, OpenRLHF 0.11.2,
TorchTitan 0.3.0 (its RL experiment) and AReaL 1.0.4, each without its distributed / inference stack.

Installed with one line (the trainers without their dependencies; loguru, spmd_types and colorlog are small, pure
Python and used at run time, so they are real; torch, numpy, packaging, omegaconf, pyyaml and transformers come
from rlkernels' `peers` extra):

    pip install --no-deps --ignore-requires-python skyrl==0.4.0 openrlhf==0.11.2 torchtitan==0.3.0 areal==1.0.4 \\
        loguru==0.7.3 spmd_types==0.2.3 colorlog==6.12.0

Two devices, as in peers.py:
- a *bare package*: a package registered (its directory, so its submodules import) without running its
  `__init__`, where the `__init__` pulls in what the loss code never uses;
- *stand-ins*: inert modules for dependencies that are missing, installed only while the trainer's modules import
  and removed from `sys.modules` afterwards (a real installed package is always used instead). The trainer's
  modules keep their references, so each stand-in is chosen where its module-level use is a decorator, an
  annotation or a CLI / logging / cluster hook the loss never calls. Stand-ins are falsy, so `if
  ray.is_initialized():` and `is_torch_npu_available()` read "no".

Bare packages stay registered (a later `import skyrl.backends` in the same process gets the bare package), and so
do the trainers' real modules. AReaL's import would also replace logging's root logger and manager and asyncio's
event-loop policy for the whole process: `areal_functional` undoes both. Each function imports once per process
and returns the same objects after; none needs the others, in any order.

The openrlhf wheel also installs a top-level `tests` package into site-packages: pytest, run from a checkout, puts
the checkout's `tests` first, but a bare `import tests` elsewhere finds OpenRLHF's.
"""

import asyncio
import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types

from ..integrations.requirements import RELEASES
from .peers import _InertModule, stand_in_modules

# the trainers CI installs with --no-deps, at the releases their adapters name (TRL comes with rlkernels[peers])
PINS = {name: RELEASES[name].split("==")[1] for name in ("skyrl", "openrlhf", "torchtitan", "areal")}
# the small real dependencies each trainer's loss modules need beyond rlkernels[peers] (pure Python, no dependencies
# of their own on Linux): SkyRL's GSPO / SAPO losses import loguru when they run, TorchTitan's loss code calls
# spmd_types, AReaL's log formatter subclasses colorlog's
EXTRA_DEPS = {"skyrl": ("loguru==0.7.3",), "torchtitan": ("spmd_types==0.2.3",), "areal": ("colorlog==6.12.0",)}
CI_PIP_LINE = ("pip install --no-deps --ignore-requires-python "
               + " ".join(f"{name}=={version}" for name, version in PINS.items())
               + " " + " ".join(dep for deps in EXTRA_DEPS.values() for dep in deps))


class _Inert(_InertModule):
    """A stand-in module: any attribute is another one, calling it returns it (or, used as a decorator, the
    decorated object), it subscripts (`Float[torch.Tensor, "b t"]`) and unions (`aiohttp.ClientSession | None`),
    and it is falsy."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self.__name__}.{name}")

    def __getitem__(self, key):
        return self

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __bool__(self):
        return False

    def __reduce__(self):  # cloudpickled with the trainer's functions (SkyRL's registries under a live Ray)
        return _Inert, (self.__name__,)


def _stand_ins(roots):
    """Inert modules (`_Inert`) for those of `roots` that are not installed, while the block runs; removed after."""
    return stand_in_modules(roots, _Inert)


def _bare_package(name: str):
    """Register package `name` (its directory, so its submodules import) without running its `__init__`."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)  # imports the parents, not `name`
    if spec is None or spec.submodule_search_locations is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _install_hint(package: str) -> str:
    pins = [f"{package}=={PINS[package]}", *EXTRA_DEPS.get(package, ())]
    return f"pip install --no-deps --ignore-requires-python {' '.join(pins)}"


def _check_pin(package: str):
    try:
        found = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"{package}=={PINS[package]} is not installed: {_install_hint(package)}") from None
    if found != PINS[package]:
        raise ImportError(f"{package} {found} is installed; these parity helpers read {package}=={PINS[package]}: "
                          f"{_install_hint(package)}")


@contextlib.contextmanager
def _import_errors(package: str):
    """A missing dependency of the trainer's modules becomes an ImportError that says what to install."""
    try:
        yield
    except ModuleNotFoundError as exc:
        raise ImportError(f"{package}=={PINS[package]}'s loss modules could not import {exc.name!r} ({exc}); "
                          f"{_install_hint(package)}") from exc


_CACHE = {}

# SkyRL: ray (its function registries mirror themselves into a named Ray actor when Ray is initialised: the
# stand-in's is_initialized() is falsy, so they stay local; `@ray.remote` returns the class), jaxtyping
# (annotations only); pandas / requests / omegaconf / yaml only where missing: skyrl_gym's tools and the YAML /
# Hydra config loaders, not AlgorithmConfig(...) in code.
_SKYRL_STAND_INS = ("ray", "jaxtyping", "pandas", "requests", "omegaconf", "yaml")


def skyrl_ppo_utils():
    """SkyRL 0.4.0's loss code: a namespace with `ppo_utils` (`skyrl.backends.skyrl_train.utils.ppo_utils`:
    `ppo_policy_loss`, `reduce_loss`, `PolicyLossRegistry`, ...), `off_policy_correction_utils`, `torch_utils`
    (`safe_exp_delta`, `masked_mean`), `AlgorithmConfig`, `OffPolicyCorrectionConfig` and `PolicyLossRegistry`.

    `skyrl.backends` is bare: its `__init__` imports the Tinker backend, whose pydantic `TypedDict`s refuse Python
    < 3.12 (SkyRL 0.4.0 asks for >= 3.12; the loss code runs on 3.11). `skyrl.train.config` imports
    `skyrl_gym`, which the skyrl wheel ships as a folder (`site-packages/skyrl-gym/skyrl_gym`), not an
    importable package: that folder is put on `sys.path` for the import only, unless `skyrl_gym` is installed.
    Build a config as `AlgorithmConfig(policy_loss_type="dual_clip", off_policy_correction=
    OffPolicyCorrectionConfig(tis_ratio_type="token"))`."""
    if "skyrl" in _CACHE:
        return _CACHE["skyrl"]
    if sys.version_info < (3, 11):
        raise ImportError("SkyRL 0.4.0's loss code needs Python >= 3.11 (enum.StrEnum); the package says >= 3.12")
    _check_pin("skyrl")
    gym_path = None
    if importlib.util.find_spec("skyrl_gym") is None:
        root = os.path.dirname(importlib.util.find_spec("skyrl").submodule_search_locations[0])
        if os.path.isdir(os.path.join(root, "skyrl-gym", "skyrl_gym")):
            gym_path = os.path.join(root, "skyrl-gym")
    with _import_errors("skyrl"), _stand_ins(_SKYRL_STAND_INS + (() if gym_path else ("skyrl_gym",))):
        if gym_path:
            sys.path.append(gym_path)
        try:
            _bare_package("skyrl.backends")
            from skyrl.backends.skyrl_train.utils import off_policy_correction_utils, ppo_utils, torch_utils
            from skyrl.train.config import AlgorithmConfig, OffPolicyCorrectionConfig
        finally:
            if gym_path:
                sys.path.remove(gym_path)
    _CACHE["skyrl"] = types.SimpleNamespace(
        ppo_utils=ppo_utils, off_policy_correction_utils=off_policy_correction_utils, torch_utils=torch_utils,
        AlgorithmConfig=AlgorithmConfig, OffPolicyCorrectionConfig=OffPolicyCorrectionConfig,
        PolicyLossRegistry=ppo_utils.PolicyLossRegistry)
    return _CACHE["skyrl"]


def openrlhf_loss():
    """OpenRLHF 0.11.2's `openrlhf.models.loss` (`PolicyLoss`, `aggregate_loss`, ...).

    `openrlhf.models` is bare: its `__init__` imports `Actor` (flash_attn, peft, transformers). `deepspeed`,
    imported at the top of `openrlhf/models/utils.py` and used only in its ZeRO-3 leaf-module helper, is a
    stand-in where it is not installed."""
    if "openrlhf" in _CACHE:
        return _CACHE["openrlhf"]
    _check_pin("openrlhf")
    with _import_errors("openrlhf"), _stand_ins(("deepspeed",)):
        _bare_package("openrlhf.models")
        from openrlhf.models import loss
    _CACHE["openrlhf"] = loss
    return loss


def openrlhf_actor():
    """OpenRLHF 0.11.2's `openrlhf.models.actor` (`Actor`, its forward). `flash_attn` (imported at the top of
    `ring_attn_utils.py` for packed samples and ring attention) and `deepspeed` are stand-ins where they are not
    installed: an `Actor` built around a model instance with `packing_samples=False` never calls them."""
    if "openrlhf.actor" in _CACHE:
        return _CACHE["openrlhf.actor"]
    openrlhf_loss()
    with _import_errors("openrlhf"), _stand_ins(("deepspeed", "flash_attn")):
        from openrlhf.models import actor
    _CACHE["openrlhf.actor"] = actor
    return actor


def torchtitan_rl():
    """TorchTitan 0.3.0's RL losses: a namespace with `losses` (`torchtitan.experiments.rl.losses`), `GRPOLoss`,
    `DAPOLoss`, `loss` (`torchtitan.components.loss`), `ChunkedLossWrapper`, `BaseLoss` and `compute_logprobs`.

    `torchtitan.experiments.rl` is bare: its `__init__` registers the models with vLLM (vllm, triton) and sets
    PYTORCH_CUDA_ALLOC_CONF. `tyro` (the command-line parser of `torchtitan.config.manager`) is a stand-in where
    it is not installed. `spmd_types` is real: the loss code calls it."""
    if "torchtitan" in _CACHE:
        return _CACHE["torchtitan"]
    _check_pin("torchtitan")
    with _import_errors("torchtitan"), _stand_ins(("tyro",)):
        _bare_package("torchtitan.experiments.rl")
        from torchtitan.components import loss
        from torchtitan.experiments.rl import losses
    _CACHE["torchtitan"] = types.SimpleNamespace(
        losses=losses, GRPOLoss=losses.GRPOLoss, DAPOLoss=losses.DAPOLoss, loss=loss,
        ChunkedLossWrapper=loss.ChunkedLossWrapper, BaseLoss=loss.BaseLoss, compute_logprobs=loss.compute_logprobs)
    return _CACHE["torchtitan"]


# AReaL: ray (name_resolve's Ray key-value backend: `@ray.remote` and calls in methods), uvloop (cli_args calls
# uvloop.install() at import), hydra (cli_args' YAML loader), numba (`@numba.njit` on a sequence-packing helper),
# einops / torchdata (areal.utils.data's other functions); transformers only where missing
# (`is_torch_npu_available()`, `is_kernel()`: falsy).
_AREAL_STAND_INS = ("ray", "uvloop", "hydra", "numba", "einops", "torchdata", "transformers")


def _keeping_logging_root(get_logger):
    """AReaL's `getLogger` replaces `logging.Logger.root` and `logging.Logger.manager` on every call
    (areal/utils/logging.py, "Fix the logging config automatically set by transformer_engine"): every logger made
    after it in the process would hang off a new root, away from the handlers on `logging.root` (pytest's caplog
    among them). Wrapped, it puts logging's root and manager back after each call; AReaL's loggers keep their own
    handlers."""

    def getLogger(*args, **kwargs):
        root, manager = logging.Logger.root, logging.Logger.manager
        try:
            return get_logger(*args, **kwargs)
        finally:
            logging.Logger.root, logging.Logger.manager = root, manager

    getLogger.__wrapped__ = get_logger
    return getLogger


def areal_functional():
    """AReaL 1.0.4's loss code: a namespace with `functional` (`areal.utils.functional.functional`:
    `ppo_actor_loss_fn`, `apply_rejection_sampling`, `sapo_loss_fn`, ...), `cli_args` (`areal.api.cli_args`),
    `ppo_actor_loss_fn`, `apply_rejection_sampling` and `RejectionSamplingConfig`.

    `areal`, `areal.infra` and `areal.engine.fsdp_utils` are bare: their `__init__`s import the rollout / train
    controllers (aiohttp, httpx, tenacity, ...) and the FSDP engine. `colorlog` is real (AReaL's log formatter
    subclasses it). Two process-wide effects of AReaL's import are undone: its `getLogger` is wrapped (see
    `_keeping_logging_root`), and the asyncio event-loop policy that `uvloop.install()` sets (where uvloop is
    installed) is put back."""
    if "areal" in _CACHE:
        return _CACHE["areal"]
    _check_pin("areal")
    policy = asyncio.get_event_loop_policy()
    with _import_errors("areal"), _stand_ins(_AREAL_STAND_INS):
        for name in ("areal", "areal.infra", "areal.engine.fsdp_utils"):  # areal.engine's __init__ is lazy: it runs
            _bare_package(name)
        from areal.utils import logging as areal_logging

        if not hasattr(areal_logging.getLogger, "__wrapped__"):
            areal_logging.getLogger = _keeping_logging_root(areal_logging.getLogger)
        try:
            from areal.api import cli_args
            from areal.utils.functional import functional
        finally:
            asyncio.set_event_loop_policy(policy)
    _CACHE["areal"] = types.SimpleNamespace(
        functional=functional, cli_args=cli_args, ppo_actor_loss_fn=functional.ppo_actor_loss_fn,
        apply_rejection_sampling=functional.apply_rejection_sampling,
        RejectionSamplingConfig=cli_args.RejectionSamplingConfig)
    return _CACHE["areal"]


class SourceBindings(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a trainer module as the import statements of its source that bind the functions an adapter replaces
    (those `from <binds_from> import ...`), nothing else: such modules' other imports pull in the trainer's training
    stack, which does not install here.

    It goes through the import system (a finder on `sys.meta_path`, installed by `install()`), so a hook on a
    module's first import (rlkernels/integrations/activation.py) sees what it would see in the trainer's worker: the
    names bound by the trainer's own statements, once, when the trainer imports the module. Subclasses name the
    trainer's package, its modules (name -> path in the package) and `binds_from`, and load the trainer's loss code."""

    package = ""
    files: dict = {}
    binds_from = ""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.files:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=self._path(fullname))

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import ast

        path = self._path(module.__name__)
        tree = ast.parse(open(path).read())
        binding = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == self.binds_from]
        exec(compile(ast.Module(body=binding, type_ignores=[]), path, "exec"), module.__dict__)

    def _path(self, name):
        spec = importlib.util.find_spec(self.package)
        return os.path.join(spec.submodule_search_locations[0], *self.files[name])

    @classmethod
    def prepare(cls):
        """Load what the binding statements import (the trainer's loss code, bare packages)."""

    @classmethod
    def install(cls):
        """`prepare()`, and this finder on `sys.meta_path`, just before the finder of the file system (which would
        load the real files), after any import hook."""
        cls.prepare()
        if not any(isinstance(finder, cls) for finder in sys.meta_path):
            sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder), cls())


class AReaLImports(SourceBindings):
    """AReaL 1.0.4's actor module (binds `ppo_actor_loss_fn`) and FSDP engine (binds `gather_logprobs(_entropy)`)."""

    package = "areal"
    files = {"areal.trainer.ppo.actor": ("trainer", "ppo", "actor.py"),
             "areal.engine.fsdp_engine": ("engine", "fsdp_engine.py")}
    binds_from = "areal.utils.functional"

    @classmethod
    def prepare(cls):
        areal_functional()
        for package in ("areal.trainer", "areal.trainer.ppo"):  # areal.engine's __init__ is lazy: it runs
            _bare_package(package)


class SkyRLWrapperImports(SourceBindings):
    """SkyRL 0.4.0's FSDP model wrapper module (binds `logprobs_from_logits`, `chunked_entropy_from_logits`)."""

    package = "skyrl"
    files = {"skyrl.backends.skyrl_train.workers.model_wrapper": ("backends", "skyrl_train", "workers",
                                                                  "model_wrapper.py")}
    binds_from = "skyrl.backends.skyrl_train.utils.torch_utils"

    @classmethod
    def prepare(cls):
        skyrl_ppo_utils()
        _bare_package("skyrl.backends.skyrl_train.workers")
