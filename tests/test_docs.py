"""The contract is in the repository: every "SPEC §n" cited in code, tests and docs resolves to a
heading of docs/spec.md, every document cited by file name (`*.md`) is one of the repository's, and the
README links the spec. The distributed example of docs/distributed.md runs as written."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "spec.md"
CITATION = re.compile(r"SPEC(?:\.md)? §\s*(\d+(?:\.\d+)?)")
# a section cited by its name instead of its number (SPEC followed by a quoted heading): names drift
NAMED = re.compile(r"(?:spec\.md`?,? ?\(?|SPEC )\"[A-Z][^\"]{3,60}\"")
SUFFIXES = {".py", ".md", ".cu", ".cuh", ".cpp", ".sh"}


def _sources():
    for folder in ("rlkernels", "tests", "benchmarks", "csrc", "docs"):
        yield from (p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES)
    yield ROOT / "README.md"


def test_every_spec_citation_resolves_to_a_heading():
    text = SPEC.read_text()
    headings = set(re.findall(r"^##+ §(\d+(?:\.\d+)?)\. ", text, flags=re.M))
    top = {h for h in headings if "." not in h}
    assert top == {str(n) for n in range(1, len(top) + 1)}, f"spec sections: {sorted(top, key=int)}"
    unnumbered = re.findall(r"^##+ (?!§)(.+)$", text, flags=re.M)
    assert not unnumbered, f"spec sections without a number: {unnumbered}"
    cited, named = {}, {}
    for path in _sources():
        source = path.read_text(errors="ignore")
        for n in CITATION.findall(source):
            cited.setdefault(n, []).append(str(path.relative_to(ROOT)))
        for name in NAMED.findall(source):
            named.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert len(cited) > 10, "few citations found: the pattern is wrong"
    missing = {n: files[:3] for n, files in cited.items() if n not in headings}
    assert not missing, f"SPEC sections cited but not in docs/spec.md: {missing}"
    assert not named, f"spec sections cited by name, not by number (SPEC §n): {named}"


DOCUMENT = re.compile(r"(?<![\w/.-])([\w./-]*[\w-]+\.md)\b")


def test_every_cited_document_is_in_the_repository():
    """A citation of a Markdown file by name (or a path to one) must name a file of this repository, by its path
    from the root or from the citing file, or by its base name where only one file has it: nothing outside (a
    notes folder beside the checkout, a style guide) that a reader of the repository cannot open."""
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md") if ".venv" not in p.parts
             and ".git" not in p.parts}
    names = {}
    for f in files:
        names.setdefault(f.rsplit("/", 1)[-1], []).append(f)
    unresolved = {}
    for path in [*_sources(), *(ROOT / "examples").rglob("*.py"), ROOT / "setup.py", ROOT / "pyproject.toml"]:
        here = path.parent.relative_to(ROOT).as_posix()
        for cited in DOCUMENT.findall(path.read_text(errors="ignore")):
            local = os.path.normpath(os.path.join(here, cited)).replace(os.sep, "/")
            if cited in files or local in files or len(names.get(cited, [])) == 1:
                continue
            unresolved.setdefault(cited, []).append(str(path.relative_to(ROOT)))
    assert len(files) >= 3, "the pattern or the walk is wrong"
    assert not unresolved, f"documents cited but not in the repository: {unresolved}"


def test_readme_links_the_contract():
    assert "docs/spec.md" in (ROOT / "README.md").read_text()


def test_sampler_topk_example_runs():
    """docs/sampler.md's rollout-record example (SPEC §9) runs as written, in a fresh interpreter."""
    text = (ROOT / "docs" / "sampler.md").read_text()
    section = text[text.index("## The sampler's top-k"):]
    block = section[section.index("```python") + len("```python"):]
    block = block[:block.index("```")]
    code = block + "\nassert torch.isfinite(out.loss) and logits.grad is not None and div.kl.shape == (B, T)\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]


def test_distributed_example_runs_under_torchrun(tmp_path):
    """docs/distributed.md's data/context/tensor-parallel example, as written, on 4 gloo processes."""
    text = (ROOT / "docs" / "distributed.md").read_text()
    block = text[text.index("<!-- split-example"):].split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "actor/pg_loss" in run.stdout


def test_the_api_page_documents_every_public_name():
    import rlkernels
    from rlkernels import schedules

    page = (ROOT / "docs" / "api.md").read_text()
    names = [f"rlkernels.{n}" for n in rlkernels.__all__ if n not in ("__version__", "schedules")]
    names += [f"rlkernels.schedules.{n}" for n in schedules.__all__]
    missing = [n for n in names if f"::: {n}\n" not in page]
    assert not missing, f"public names without an entry in docs/api.md: {missing}"


def test_numerics_parity_example_runs():
    """docs/numerics.md's logprob_parity example runs as written and reports on every one of its response tokens,
    under the metric names it shows."""
    text = (ROOT / "docs" / "numerics.md").read_text()
    block = text[text.index("```python") + len("```python"):]
    block = block[:block.index("```")]
    namespace = {}
    exec(compile(block, "numerics.md", "exec"), namespace)
    report = namespace["report"]
    assert int(report.tokens) == 64 and 0.0 <= float(report.match_rate) <= 1.0
    assert set(namespace["logs"]) == set(report.metrics) and "logprob_parity/p[0.9,1]/max_abs_diff" in report.metrics


# ---- the newcomer's path: the README reaches every public name, and its first examples train ------------------------
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def _reachable_pages():
    """The Markdown pages a reader reaches from the README by following links, the API reference excepted (it lists
    every name by construction: a name only there is one a newcomer finds by its name alone)."""
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop().resolve()
        if page in seen or not page.exists() or page.name == "api.md":
            continue
        seen.add(page)
        todo += [page.parent / link for link in LINK.findall(page.read_text())]
    return seen


def test_every_public_name_is_on_a_page_the_readme_reaches():
    import rlkernels
    from rlkernels import schedules

    pages = _reachable_pages()
    assert {"README.md", "guide.md", "numerics.md", "sampler.md", "integrations.md"} <= {p.name for p in pages}
    text = "\n".join(p.read_text() for p in pages)
    names = [n for n in rlkernels.__all__ if n not in ("__version__", "schedules")]
    names += [f"schedules.{n}" for n in schedules.__all__]
    # in code, as a reader would search for it: `name`, `name(...)`, `rlkernels.name`, `Name.field`
    missing = [n for n in names if not re.search(rf"`(?:rlkernels\.)?{re.escape(n)}[`(.\[]", text)]
    assert not missing, f"public names no page reachable from the README mentions: {missing}"


def _python_blocks(path: Path):
    text = path.read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def _realistic_batch(B: int, T: int, V: int, sigma: float, seed: int = 0):
    """A padded batch with a bf16/FP8-sized mismatch (the issue's): the proximal policy 0.01 and the sampler `sigma`
    nats per token away from the current log-probs, i.i.d. per token; one advantage per sequence."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    return dict(logits=logits, labels=labels, advantages=torch.randn(B, 1, generator=g).expand(B, T).contiguous(),
                response_mask=torch.ones(B, T), old_lp=lp + 0.01 * torch.randn(B, T, generator=g),
                vllm_lp=lp + sigma * torch.randn(B, T, generator=g))


class _Logger:
    def log(self, values):
        assert isinstance(values, dict) and values



HEADLINES = [("README.md", 0), ("docs/guide.md", 0)]  # each page's first Python block: the loss from logits
HIDDEN = [("README.md", 1), ("docs/guide.md", 1)]  # the second: the loss from hidden states


def _run_logits_block(code: str, B: int, T: int, sigma: float):
    batch = _realistic_batch(B, T, 1000, sigma)
    namespace = dict(batch, logger=_Logger())
    namespace["logits"] = batch["logits"].requires_grad_(True)
    exec(compile(code, "example", "exec"), namespace)
    return namespace["out"], namespace["logits"].grad


@pytest.mark.parametrize("page, index", HEADLINES)
@pytest.mark.parametrize("T, sigma", [(16, 0.01), (16, 0.05), (256, 0.05)])
def test_the_headline_example_trains_on_a_realistic_mismatch(page, index, T, sigma):
    """The first example of the README and of the guide, as written, on 64 sequences whose sampler is sigma nats
    per token away: a nonzero gradient, and its correction keeps every token (what its comment says)."""
    out, grad = _run_logits_block(_python_blocks(ROOT / page)[index], 64, T, sigma)
    assert grad is not None and float(grad.abs().sum()) > 0
    assert bool(out.mask.all()), f"{page}: the headline correction rejected {1 - float(out.mask.float().mean()):.0%}"


def test_the_old_headline_trains_on_nothing_and_says_so():
    """The negative control of the test above: the same block with verl's geo_rs band (the README's example before)
    rejects every sequence of the issue's batch (4 x 16, sigma 0.05), so its gradient is exactly 0; the step sets
    rollout_rs_all_rejected and warns (tested once per process in tests/test_notices.py)."""
    code = _python_blocks(ROOT / "README.md")[0].replace("RolloutCorrection.token_tis()",
                                                         "RolloutCorrection.geo_rs_token_tis()")
    assert "geo_rs_token_tis()" in code
    with warnings.catch_warnings():  # its once-per-process warning: tests/test_notices.py, in fresh interpreters
        warnings.simplefilter("ignore")
        out, grad = _run_logits_block(code, 4, 16, 0.05)
    assert float(grad.abs().sum()) == 0.0 and not bool(out.mask.any())
    assert float(out.metrics["rollout_corr/rollout_rs_all_rejected"]) == 1.0


@pytest.mark.parametrize("page, index", HIDDEN)
def test_the_hidden_state_example_trains_on_a_realistic_mismatch(page, index):
    """The loss from hidden states as the README and the guide write it, on 16 packed sequences of 256 tokens, the
    sampler 0.05 nats per token away: a nonzero gradient to the hidden states and the head."""
    g = torch.Generator().manual_seed(0)
    S, T, H, V = 16, 256, 32, 500
    N = S * T
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    labels = torch.randint(0, V, (N,), generator=g)
    with torch.no_grad():
        lp = torch.log_softmax(hidden @ head.weight.T, -1).gather(-1, labels[:, None]).squeeze(-1)
    model = type("Model", (), {"lm_head": head})()
    namespace = dict(hidden=hidden, model=model, labels=labels, advantages=torch.randn(N, generator=g),
                     response_mask=torch.ones(N), vllm_lp=lp + 0.05 * torch.randn(N, generator=g),
                     cu_seqlens=torch.arange(0, N + 1, T), torch=torch)
    exec(compile("import rlkernels\nfrom rlkernels import PolicyLossConfig, RolloutCorrection\n"
                 + _python_blocks(ROOT / page)[index], "example", "exec"), namespace)
    assert float(hidden.grad.abs().sum()) > 0 and float(head.weight.grad.abs().sum()) > 0
    assert float(namespace["out"].mask.float().mean()) > 0.99


def test_every_loss_type_is_listed_where_a_user_chooses_one():
    """README's table of losses, the guide's option list and docs/losses.md each name every `loss_type` value."""
    from rlkernels.config import LOSS_TYPES

    for page in ("README.md", "docs/guide.md", "docs/losses.md"):
        text = (ROOT / page).read_text()
        missing = [name for name in LOSS_TYPES if f"`{name}`" not in text and f'"{name}"' not in text]
        assert not missing, f"{page} does not name loss_type {missing}"
