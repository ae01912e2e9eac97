"""The peers' own code, importable on a CPU machine without their whole stacks, and the examples' tiny
models (in a checkout: examples/ beside the package): shared by the tests (tests/peers, tests/integrations) and
the benchmarks.

verl imports ray (and, in places, transformers) at module level, but its loss functions, driver-side
rollout correction and FSDP engine code need neither on a CPU. `inert_ray_transformers` stands in for the
missing ones while verl imports, and only then. vLLM's V2 sampler kernels come from its wheel, two files
unpacked (`vllm_v2_sampler`); its V1 sampler's arithmetic is three ATen calls (`vllm_v1_processed_logprobs`).
"""

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path


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
    """Imports every module under `roots` as an instance of `module_class` (an inert stand-in)."""

    def __init__(self, roots, module_class):
        self.roots, self.module_class = frozenset(roots), module_class

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = self.module_class(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def stand_in_modules(roots, module_class=_InertModule):
    """Inert modules for those of `roots` that are neither imported nor installed, while the block runs (it gets
    their names); removed afterwards, so that nothing later finds a fake."""
    missing = [r for r in roots if r not in sys.modules and importlib.util.find_spec(r) is None]
    finder = _InertFinder(missing, module_class)
    if missing:
        sys.meta_path.insert(0, finder)
    try:
        yield missing
    finally:
        if missing:
            sys.meta_path.remove(finder)
            for key in list(sys.modules):
                if key.split(".")[0] in finder.roots and isinstance(sys.modules[key], module_class):
                    del sys.modules[key]


@contextlib.contextmanager
def inert_ray_transformers():
    """verl imports ray and transformers at module level but the loss functions need neither.

    Placeholders are installed only if the real packages are missing, and removed afterwards (Liger
    probes `transformers` and takes a wrong branch if it finds a fake one)."""
    with stand_in_modules(("ray", "transformers")):
        yield


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


VLLM_VERSION = "0.33.0"
VLLM_SAMPLER_FILES = ("vllm/v1/worker/gpu/sample/logprob.py", "vllm/v1/worker/gpu/sample/gumbel.py")


def _vllm_files() -> Path:
    """vLLM's two V2 sampler files, unpacked once per machine into the rlkernels cache (the 336 MB wheel is not
    kept). RuntimeError, with pip's words, where the wheel cannot be fetched."""
    from ..backends.cpu_backend import cache_dir

    root = cache_dir() / "peers" / f"vllm-{VLLM_VERSION}"
    if all((root / f).is_file() for f in VLLM_SAMPLER_FILES):
        return root
    wheels = root / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    for stale in wheels.glob("*.whl"):  # an interrupted earlier fetch
        stale.unlink()
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"vllm=={VLLM_VERSION}", "-d",
                        str(wheels)], check=True, capture_output=True, text=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"vllm=={VLLM_VERSION}'s wheel could not be fetched: "
                           f"{str(getattr(exc, 'stderr', None) or exc)[-300:]}") from exc
    found = sorted(wheels.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not found:
        raise RuntimeError(f"pip left no vllm-{VLLM_VERSION} wheel in {wheels}")
    wheel = found[0]
    with zipfile.ZipFile(wheel) as archive:
        for f in VLLM_SAMPLER_FILES:
            target = root / f
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(f))
    wheel.unlink()
    return root


def vllm_v2_sampler() -> dict:
    """{"logprob": module, "gumbel": module}: vLLM's V2 sampler's log-prob and temperature kernels, loaded from its
    own files with stand-ins for the `vllm.*` imports they name (restored after)."""
    import triton
    import triton.language as tl

    root = _vllm_files()
    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.triton_utils": types.SimpleNamespace(tl=tl, triton=triton),
        "vllm.sampling_params": types.SimpleNamespace(MAX_LOGPROB_TOKEN_IDS=0, SamplingParams=object),
        "vllm.v1.outputs": types.SimpleNamespace(LogprobsTensors=object),
        "vllm.v1.worker.gpu.buffer_utils": types.SimpleNamespace(StagedWriteTensor=object, UvaBackedTensor=object),
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        modules = {}
        for f in VLLM_SAMPLER_FILES:
            spec = importlib.util.spec_from_file_location("vllm_v2_" + Path(f).stem, root / f)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            modules[Path(f).stem] = module
        return modules
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def vllm_v1_processed_logprobs(logits, labels, temperature):
    """What vLLM's V1 sampler returns for the sampled tokens (vllm/v1/sample/sampler.py), its three ATen calls on
    a batch of requests [N, V]: `logits.to(torch.float32)` (:158), `logits.div_(temp.unsqueeze(dim=1))` with the
    float32 per-request temperatures (:291-300), `logits.log_softmax(dim=-1, dtype=torch.float32)` (:368-370);
    0 where a label is outside [0, V). `temperature`: a float, or one per label."""
    import torch

    V = logits.shape[-1]
    rows = logits.reshape(-1, V).to(torch.float32).clone()  # V1's float32 logits: a copy of ours
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(labels.shape).reshape(-1)
    rows.div_(t.clone().unsqueeze(dim=1))
    lp = rows.log_softmax(dim=-1, dtype=torch.float32)
    flat = labels.reshape(-1)
    got = lp.gather(1, flat.clamp(0, V - 1)[:, None]).squeeze(1)
    return torch.where((flat >= 0) & (flat < V), got, 0.0).reshape(labels.shape)


def vllm_v2_processed_logprobs(kernels: dict, logits, labels, temperatures):
    """What vLLM's V2 sampler returns for the sampled tokens (sampler.py: apply_sampling_params, then
    compute_topk_scores): the logits as they are when no request needs processing, else a float32 copy with each
    row divided by its temperature; then its log-softmax kernel at the sampled ids."""
    import torch

    if bool(((temperatures != 0) & (temperatures != 1)).any()):
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        kernels["gumbel"].apply_temperature(logits, torch.arange(logits.shape[0], device=logits.device), temperatures)
    return kernels["logprob"].compute_token_logprobs(logits, labels[:, None])[:, 0]
