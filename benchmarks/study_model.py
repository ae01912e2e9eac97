"""The model, sampler and task machinery both studies share (benchmarks/mismatch_study.py, the mismatch study;
benchmarks/collapse_study.py, the collapse regime): the tiny causal LM (`Block`, `TinyLM`), its served copy (FP8
E4M3 weights per output row, bf16 activations: `sampler_model`, `load_served`), token-by-token decoding from a KV
cache with the sampler's top-k (`generate`), the trainer's float32 pass (`trainer_inputs`, `response_hidden`), the
supervised start, the reward (the fraction of positions right) and the summaries and plots' helpers. Each study
keeps its own task (`make_prompts`), arms and loop; neither study imports the other's module for these.
"""

import copy
import dataclasses
import math
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F

import rlkernels

PAD, BOS, SEP, EOS = 0, 1, 2, 3


FIRST_NUMBER = 4


@dataclasses.dataclass
class StudyConfig:
    vocab: int = 256
    values: int = 32  # the numbers are ids FIRST_NUMBER .. FIRST_NUMBER + values - 1; the other ids are tail
    min_items: int = 8
    max_items: int = 20
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    sft_steps: int = 100
    sft_batch: int = 64
    sft_lr: float = 3e-3
    rl_steps: int = 250
    prompts_per_step: int = 16
    group_size: int = 8
    minibatches: int = 2
    lr: float = 1e-3
    grad_clip: float = 1.0
    sampler: str = "fp8"  # fp32 | bf16 | fp16 | fp8: the sampler's numeric path (see module docstring)
    top_p: float = 1.0
    staleness: int = 2  # the sampler's weights lag the trainer's by this many steps (asynchronous rollouts)
    temperature: float = 1.0
    seeds: int = 3
    collapse_margin: float = 0.15  # collapse: the reward's 10-step mean falls this far below its running peak
    backend: str = "auto"

    @property
    def max_response(self) -> int:
        return self.max_items + 4

    @property
    def prompt_width(self) -> int:
        return self.max_items + 2  # BOS, the numbers, SEP


SAMPLER_TOPK = 20  # the sampler's top-k the trm_seq_max_kl arm reads (vLLM's default max_logprobs)


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.float32_attention = False  # a served copy's: `flash_attention_arithmetic`
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def attend(self, x, mask, cache=None):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.float32_attention:  # the cache then keeps the upcast values (exact)
            q, k, v = q.float(), k.float(), v.float()
        if cache is not None:  # decoding: this step's keys and values join the cache
            if cache:
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
            cache[:] = [k, v]
        if self.float32_attention:
            y = flash_attention_arithmetic(q, k, v, mask, x.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))

    def forward(self, x, mask, cache=None):
        x = x + self.attend(x, mask, cache)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def flash_attention_arithmetic(q, k, v, mask, dtype: torch.dtype) -> torch.Tensor:
    """Attention as a flash kernel computes it on a reduced-precision copy (`dtype`): q, k, v are that dtype's values
    (held in float32: their products are exact), the scores, softmax and accumulations in float32, the probabilities
    rounded to `dtype` before their product with v, the output rounded once; the same up to summation order. A
    served copy's (`Block.float32_attention`): the CPU's own bfloat16 attention takes 3-4x as long at the study's
    shapes and rounds its scaled inputs to bfloat16, which a GPU flash kernel does not. Every row of `mask` has a
    key (`sequence_mask`)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, -math.inf)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    return (torch.matmul(p.to(dtype).float(), v) / p.sum(-1, keepdim=True)).to(dtype)


class TinyLM(torch.nn.Module):
    """A pre-LN causal transformer with learned positions; `hidden` gives the final normed states, whose product
    with `head` are the logits (the loss takes them with the head, as the fused-linear path does)."""

    def __init__(self, cfg: StudyConfig):
        super().__init__()
        self.tok = torch.nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = torch.nn.Embedding(cfg.prompt_width + cfg.max_response, cfg.d_model)
        self.blocks = torch.nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.norm = torch.nn.LayerNorm(cfg.d_model)
        self.head = torch.nn.Linear(cfg.d_model, cfg.vocab)

    def hidden(self, tokens, positions, mask, caches=None):
        x = self.tok(tokens) + self.pos(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if caches is None else caches[i])
        return self.norm(x)


def sequence_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, T] valid tokens -> [B, 1, T, T] causal attention over valid keys; a query also sees itself, so a
    padding row never has an empty softmax."""
    T = valid.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return (causal & valid[:, None, :])[:, None] | torch.eye(T, dtype=torch.bool)


def positions_of(valid: torch.Tensor) -> torch.Tensor:
    return (valid.long().cumsum(1) - 1).clamp_min(0)


def quantize_fp8_rows(w: torch.Tensor) -> torch.Tensor:
    """W8 (FP8 E4M3, one scale per output row, as vLLM's FP8 weight quantisation) -> dequantised."""
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


SAMPLER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def sampler_model(model: TinyLM, path: str) -> TinyLM:
    """A copy of the trainer's model as the inference engine would serve it."""
    served = copy.deepcopy(model).to(SAMPLER_DTYPES[path]).requires_grad_(False)
    load_served(served, model.state_dict(), path)
    return served


@torch.no_grad()
def load_served(served: TinyLM, state: Dict[str, torch.Tensor], path: str) -> None:
    """The weight update of the inference engine: the trainer's (possibly stale) weights, cast to the served
    dtype; on the fp8 path the blocks' linear weights are quantised first (the embeddings and the LM head stay
    in bfloat16, as vLLM keeps them)."""
    for name, param in served.named_parameters():
        value = state[name]
        if path == "fp8" and name.startswith("blocks.") and name.endswith("weight") and value.dim() == 2:
            value = quantize_fp8_rows(value)
        param.copy_(value)


def rewards_of(responses: torch.Tensor, lengths: torch.Tensor, targets: List[List[int]]) -> torch.Tensor:
    """Fraction of positions equal to the target, over max(length without EOS, target length)."""
    out = []
    for row, n, target in zip(responses.tolist(), lengths.tolist(), targets):
        body = row[:n]
        if body and body[-1] == EOS:
            body = body[:-1]
        hits = sum(a == b for a, b in zip(body, target))
        out.append(hits / max(len(body), len(target)))
    return torch.tensor(out)


def supervised_start(cfg: StudyConfig, seed: int, prompts_of, build=TinyLM) -> TinyLM:
    """A brief supervised phase on correct answers (teacher forcing), float32: the model `build(cfg)` makes, on the
    prompts and targets `prompts_of(cfg, n, generator)` draws (each study's own task)."""
    torch.manual_seed(seed)
    model = build(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.sft_lr)
    g = torch.Generator().manual_seed(10_000 + seed)
    R = cfg.max_response
    for _ in range(cfg.sft_steps):
        prompts, valid, targets = prompts_of(cfg, cfg.sft_batch, g)
        responses = torch.full((len(targets), R), PAD, dtype=torch.long)
        for i, t in enumerate(targets):
            responses[i, :len(t) + 1] = torch.tensor(t + [EOS])
        lengths = torch.tensor([len(t) + 1 for t in targets])
        tokens, seq_valid, labels_mask = trainer_inputs(cfg, prompts, valid, responses, lengths)
        logits = model.head(response_hidden(model, cfg, tokens, seq_valid))
        loss = F.cross_entropy(logits[labels_mask], responses[labels_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def generate(served: TinyLM, cfg: StudyConfig, prompts, valid, g: torch.Generator):
    """Sample responses from the served model, token by token from a KV cache; returns the responses [B, R]
    (PAD after EOS), their lengths (EOS included) and the log-probs of the sampled tokens under the sampler's
    processed distribution (softmax of the float32-cast logits / T, then top-p renormalised), 0 past the end; and the
    sampler's top-k of that distribution at each position ([B, R, k] ids, -1 past the end, and their log-probs), as
    vLLM's logprobs=k returns them (drawing them consumes no randomness: the samples are those without them)."""
    B, P = prompts.shape
    R = cfg.max_response
    k = min(SAMPLER_TOPK, cfg.vocab)
    topk_ids = torch.full((B, R, k), -1, dtype=torch.long)
    topk_lp = torch.zeros(B, R, k)
    caches = [[] for _ in served.blocks]
    keys_valid = valid.clone()
    mask = sequence_mask(keys_valid)
    h = served.hidden(prompts, positions_of(valid), mask, caches)[:, -1:]
    position = valid.long().sum(1, keepdim=True)
    responses = torch.full((B, R), PAD, dtype=torch.long)
    logprobs = torch.zeros(B, R)
    alive = torch.ones(B, dtype=torch.bool)
    for t in range(R):
        logp = torch.log_softmax(served.head(h[:, 0]).float() / cfg.temperature, -1)
        if cfg.top_p < 1.0:
            logp = top_p_logprobs(logp, cfg.top_p)
        token = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
        token = torch.where(alive, token, torch.full_like(token, PAD))
        responses[:, t] = token
        logprobs[:, t] = torch.where(alive, logp.gather(1, token[:, None])[:, 0], torch.zeros(()))
        top = logp.topk(k, -1)
        topk_ids[:, t] = torch.where(alive[:, None] & (top.values > -math.inf), top.indices, -1)
        topk_lp[:, t] = torch.where(alive[:, None], top.values, torch.zeros(()))
        alive = alive & (token != EOS)
        if not alive.any():
            break
        keys_valid = torch.cat([keys_valid, torch.ones(B, 1, dtype=torch.bool)], 1)
        h = served.hidden(token[:, None], position + t, keys_valid[:, None, None, :], caches)
    lengths = ((responses != PAD).sum(1)).clamp_max(R)
    return responses, lengths, logprobs, (topk_ids, topk_lp)


def top_p_logprobs(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus: the smallest set of most likely tokens whose mass reaches top_p, renormalised (-inf off it)."""
    sorted_lp, order = logp.sort(-1, descending=True)
    before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass strictly above each token
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = logp.masked_fill(~keep, -math.inf)
    return kept - torch.logsumexp(kept, -1, keepdim=True)


def trainer_inputs(cfg: StudyConfig, prompts, valid, responses, lengths):
    R = cfg.max_response
    response_mask = torch.arange(R)[None] < lengths[:, None]
    seq_valid = torch.cat([valid, response_mask], 1)
    tokens = torch.cat([prompts, responses], 1)
    return tokens, seq_valid, response_mask


def response_hidden(model: TinyLM, cfg: StudyConfig, tokens, seq_valid):
    """The trainer's float32 pass: the states that predict each response token, [B, R, d]."""
    h = model.hidden(tokens, positions_of(seq_valid), sequence_mask(seq_valid))
    return h[:, cfg.prompt_width - 1:-1]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / max(1, len(xs))


def summarise(arm_result: dict) -> dict:
    """Per arm, over its seeds: the reward of the first and last tenth of the steps, the first collapsed step of
    each seed (None: never), the mean rejected fraction, the time per step, and the soak figures (resident
    memory's peak per 100 steps, seconds per step over the first and the last 100 steps, any NaN)."""
    seeds = arm_result["seeds"]
    tenth = max(1, len(seeds[0]["reward"]) // 10)
    final = [_mean(s["reward"][-tenth:]) for s in seeds]
    windows = range(0, len(seeds[0]["step"]), 100)
    return dict(
        initial_reward=_mean(_mean(s["reward"][:tenth]) for s in seeds),
        final_reward_mean=_mean(final), final_reward_min=min(final), final_reward_max=max(final),
        steps_to_collapse=[next((i for i, c in enumerate(s["collapsed"]) if c), None) for s in seeds],
        rejected_seq_fraction=_mean(_mean(s["rejected_seq_fraction"]) for s in seeds),
        chi2_token=_mean(_mean(s["chi2_token"]) for s in seeds),
        out_of_band_fraction=_mean(_mean(s["out_of_band_fraction"]) for s in seeds),
        seconds_per_step=_mean(_mean(s["seconds"][1:]) for s in seeds),
        seconds_per_step_first_100=_mean(_mean(s["seconds"][1:101]) for s in seeds),
        seconds_per_step_last_100=_mean(_mean(s["seconds"][-100:]) for s in seeds),
        rss_peak_mib_per_100_steps=[max(max(s["rss_mib"][w:w + 100]) for s in seeds) for w in windows],
        nan=any(not math.isfinite(x) for s in seeds for x in s["reward"] + s["grad_norm"] + s["loss"]))


def backend_name(backend: str) -> str:
    if backend != "auto":
        return backend
    return "cpu" if rlkernels.backends.available().get("cpu") else "torch"


def _smoothed(series: torch.Tensor, width: int = 10) -> torch.Tensor:
    """Trailing mean over `width` steps ([seeds, steps] -> the same shape)."""
    kernel = torch.ones(1, 1, width, dtype=series.dtype) / width
    padded = torch.cat([series[:, :1].expand(-1, width - 1), series], 1)
    return torch.nn.functional.conv1d(padded[:, None], kernel)[:, 0]


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a note) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return None
    return plt


def _rounded(value):
    """Floats to 7 significant digits (float32's precision) for a JSON a third the size."""
    if isinstance(value, float):
        return float(f"{value:.7g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value
