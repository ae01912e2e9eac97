"""`python -m rlkernels.demo`: a synthetic RL batch with a train-inference mismatch, corrected five ways.

Builds a packed batch of a few hundred responses over a realistic vocabulary, simulates what an
inference engine reports (the same model with perturbed logits, plus a few "toxic" responses whose
probabilities drifted far), runs `decoupled_ppo_loss` with several rollout-correction presets,
prints the loss and the diagnostics with a health verdict, and times the fused loss against the
naive PyTorch composition a trainer would otherwise write.
"""

import argparse
import time

import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

# Health thresholds from the rollout-correction literature (verl docs, "When Speed Kills Stability")
HEALTH = {
    "rollout_corr/rollout_is_mean": ("mean IS weight", lambda v: 0.5 <= v <= 2.0, "in [0.5, 2]"),
    "rollout_corr/rollout_is_eff_sample_size": ("ESS", lambda v: v >= 0.3, ">= 0.3"),
    "rollout_corr/kl": ("kl(mu||pi)", lambda v: abs(v) <= 0.1, "|kl| <= 0.1"),
    "rollout_corr/chi2_token": ("chi2 token", lambda v: v <= 1.0, "<= 1"),
}

PRESETS = {
    "none (plain PPO)": None,
    "token-TIS (C=2)": RolloutCorrection.token_tis(),
    "seq-MIS": RolloutCorrection.seq_mis(),
    "Geo-RS + token-TIS": RolloutCorrection.geo_rs_token_tis(bounds=(0.9, 1.1)),
    "IcePop": RolloutCorrection.icepop(),
    "K3-RS": RolloutCorrection.k3_rs(threshold=0.05),
}


def synthetic_batch(num_seqs: int, vocab: int, device, seed: int = 0, dtype=torch.float32):
    """A packed batch: logits of the trainer, and what the inference engine reported for them."""
    torch.manual_seed(seed)  # the label sampler below draws from the global generator
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(8, 65, (num_seqs,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    N = int(cu[-1])
    logits = (torch.randn(N, vocab, generator=g) * 2.5).to(device=device, dtype=dtype)
    labels = torch.distributions.Categorical(logits=logits.float()).sample().to(device)
    with torch.no_grad():
        lp = torch.log_softmax(logits.float(), -1).gather(1, labels[:, None]).squeeze(1)
        # the engine's numerics: the same model with slightly different logits (bf16 kernels, ...)
        noisy = logits.float() + 0.08 * torch.randn(N, vocab, generator=g).to(device)
        rollout = torch.log_softmax(noisy, -1).gather(1, labels[:, None]).squeeze(1)
    # a few toxic responses whose engine probabilities drifted far (the failure the fixes target)
    toxic = torch.zeros(N, dtype=torch.bool, device=device)
    for i in torch.randperm(num_seqs, generator=g)[: max(1, num_seqs // 50)].tolist():
        toxic[cu[i]: cu[i + 1]] = True
    rollout = torch.where(toxic, rollout - 1.5, rollout)
    old = lp - 0.02 * torch.randn(N, generator=g).to(device)  # the proximal policy: one step behind
    seq_reward = torch.randn(num_seqs, generator=g).to(device)
    advantages = seq_reward.repeat_interleave(lengths.to(device))
    mask = torch.ones(N, dtype=torch.bool, device=device)
    mask[cu[:-1].to(device)] = False  # the first token of each row is prompt, not response
    return dict(logits=logits, labels=labels, advantages=advantages, response_mask=mask, old_logprobs=old,
                rollout_logprobs=rollout, cu_seqlens=cu.to(device))


def naive_decoupled_ppo(logits, labels, advantages, response_mask, old_logprobs, rollout_logprobs, clip=0.2, C=2.0):
    """What a trainer writes today: fp32 log-softmax over [N, V], gather, token TIS, PPO clip, masked mean."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    w = torch.exp((old_logprobs - rollout_logprobs).clamp(-20, 20)).clamp(max=C).detach()
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip, 1 + clip)
    per_token = torch.maximum(loss1, loss2)
    per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * 3.0), per_token) * w
    m = response_mask.float()
    return (per_token * m).sum() / m.sum().clamp_min(1)


def _time(fn, repeats: int, device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batch = synthetic_batch(args.sequences, args.vocab, device)
    N = batch["labels"].numel()
    print(f"rlkernels {rlkernels.__version__} demo: {args.sequences} responses, {N} tokens, vocab {args.vocab}, "
          f"{batch['logits'].dtype} logits on {device} ({N * args.vocab * batch['logits'].element_size() / 2**30:.2f} GiB)\n")

    rows = []
    for name, rc in PRESETS.items():
        logits = batch["logits"].clone().requires_grad_(True)
        out = rlkernels.decoupled_ppo_loss(logits, **{k: v for k, v in batch.items() if k != "logits"},
                                           config=PolicyLossConfig(rollout_correction=rc))
        out.loss.backward()
        m = rlkernels.metrics_to_floats(out.metrics)  # one host sync for every metric
        kept = out.mask.sum().item() / max(1, batch["response_mask"].sum().item())
        failed = [label for key, (label, ok, _) in HEALTH.items() if key in m and not ok(m[key])]
        rows.append((name, out.loss.item(), kept, m.get("rollout_corr/rollout_is_mean"),
                     m.get("rollout_corr/rollout_is_eff_sample_size"), m["rollout_corr/kl"], m["rollout_corr/chi2_token"],
                     m["actor/pg_clipfrac"], "healthy" if not failed else "check " + ", ".join(failed)))

    header = f"{'preset':<20} {'loss':>9} {'kept':>6} {'IS mean':>8} {'ESS':>6} {'kl':>8} {'chi2_tok':>9} {'clipfrac':>8}  verdict"
    print(header)
    print("-" * len(header))
    fmt = lambda v, width: f"{'-':>{width}}" if v is None else f"{v:>{width}.3f}"  # noqa: E731
    for name, loss, kept, is_mean, ess, kl, chi2, clipfrac, verdict in rows:
        print(f"{name:<20} {loss:>9.5f} {kept:>6.1%} {fmt(is_mean, 8)} {fmt(ess, 6)} {kl:>8.4f} "
              f"{chi2:>9.4f} {clipfrac:>8.3f}  {verdict}")
    print("\nhealth thresholds: " + "; ".join(f"{label} {rule}" for label, _, rule in HEALTH.values()))

    # timing: fused token-TIS loss vs the naive composition of the same loss (fwd + bwd)
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection.token_tis())
    rest = {k: v for k, v in batch.items() if k not in ("logits", "cu_seqlens")}
    logits = batch["logits"].clone().requires_grad_(True)

    def fused():
        logits.grad = None
        rlkernels.decoupled_ppo_loss(logits, cu_seqlens=batch["cu_seqlens"], config=cfg, **rest).loss.backward()

    def naive():
        logits.grad = None
        naive_decoupled_ppo(logits, **rest).backward()

    with torch.no_grad():
        a = rlkernels.decoupled_ppo_loss(batch["logits"], cu_seqlens=batch["cu_seqlens"], config=cfg, **rest).loss
        b = naive_decoupled_ppo(batch["logits"], **rest)
    t_fused, t_naive = _time(fused, args.repeats, device), _time(naive, args.repeats, device)
    backend = rlkernels.backends.select("auto", batch["logits"]).name
    print(f"\nfwd+bwd, token-TIS: rlkernels ({backend} backend) {t_fused * 1e3:.1f} ms vs naive PyTorch "
          f"{t_naive * 1e3:.1f} ms ({t_naive / t_fused:.2f}x); losses {a.item():.6f} vs {b.item():.6f}")


if __name__ == "__main__":
    main()
