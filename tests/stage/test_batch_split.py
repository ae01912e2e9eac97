"""Data- and context-parallel splits (`dp_group=`, `cp_group=`, `token_index=`), alone and in grids with
vocabulary parallelism (`tp_group=`), on real gloo groups, against the single-process computation on
the whole batch.

Every rank builds the same global batch (packed: eight sequences, one empty and one all-masked;
padded: four rows), keeps its share -- a contiguous run of sequences for its data-parallel rank,
then a slice of that run's token axis (uneven, crossing sequence boundaries, possibly empty) or a
zigzag set of positions for its context-parallel rank, then a vocabulary shard for its tensor-parallel
rank -- and checks, for a set of configurations drawn over the option product:

* metrics equal to the single-process ones and bitwise identical on every rank;
* its gradient equal to its rows of the single-process gradient, times the data-parallel size (DDP
  and FSDP average gradients); the ranks' losses summed over context-parallel ranks and averaged
  over data-parallel ones equal the single-process loss;
* its log-probs, IS weights and final mask equal to its rows of the single-process ones;
* the collectives per call and per group: all_gather only, 2 on dp_group (normalisers, metrics),
  3 on cp_group (slice sizes, sequence sums, metrics; 2 with token_index and cu_seqlens), 1 on
  tp_group, none in the backward of the logits path; the bytes each rank sends on dp_group and
  cp_group depend on the number of sequences and metrics, never on the number of tokens.

float64 to 1e-12 relative (the combine only reorders float64 sums); float32 within the tolerance
table's "reordered" entry (the same fp32 formulas, summed in another order).
"""

import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rlkernels.testing.spawn import Collectives, spawn

V = 11
LENGTHS = [5, 0, 7, 3, 1, 6, 4, 2]  # packed; sequence 3 is all-masked
B, T = 4, 7  # padded
DP_CUTS = {1: [0, 8], 2: [0, 3, 8], 3: [0, 2, 2, 8]}  # sequences per data-parallel rank (rank 1 of 3: none)
ROW_CUTS = {1: [0, 4], 2: [0, 1, 4], 3: [0, 2, 2, 4]}  # padded rows per data-parallel rank
CP_FRACTIONS = {1: [], 2: [0.4], 3: [0.35, 0.35]}  # slice ends, as fractions of the axis (rank 1 of 3: none)
# SPEC §8.1: a length quantile needs every sequence's length, which a data-parallel split does not gather
NOT_ON_DATA_PARALLEL_SPLITS = {"response_length/p90"}


def _coords(rank, tp, cp):
    """rank = (d * cp + c) * tp + t: tensor-parallel ranks adjacent, as Megatron lays them out."""
    return rank // (tp * cp), (rank // tp) % cp, rank % tp


def _make_groups(tp, dp, cp):
    """The grid as a device mesh (row-major over dp, cp, tp, as _coords numbers the ranks); a group
    of size 1 is passed as None, as a trainer without that parallelism would."""
    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    return {kind: mesh.get_group(kind) for kind, size in (("tp", tp), ("dp", dp), ("cp", cp)) if size > 1}


def _slices(n, cp):
    cuts = [0] + [int(round(f * n)) for f in CP_FRACTIONS[cp]] + [n]
    return [torch.arange(cuts[c], cuts[c + 1]) for c in range(cp)]


def _zigzag(lengths, cp):
    """Ring attention's layout: each sequence in 2 cp chunks, rank c takes chunks c and 2 cp - 1 - c."""
    ranks, start = [[] for _ in range(cp)], 0
    for n in lengths:
        chunks = torch.arange(start, start + n).tensor_split(2 * cp)
        for c in range(cp):
            ranks[c] += [chunks[c], chunks[2 * cp - 1 - c]]
        start += n
    return [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long) for parts in ranks]


class _Share:
    """This rank's part of the global batch: rows (into the flattened global token axis), the
    per-token tensors, the cu_seqlens of its data-parallel batch and, for zigzag, token_index."""

    def __init__(self, batch, layout, d, c, dp, cp, zigzag):
        if layout == "packed":
            cut = DP_CUTS[dp]
            seq_lengths = LENGTHS[cut[d]:cut[d + 1]]
            start = sum(LENGTHS[:cut[d]])
            n = sum(seq_lengths)
            local = _zigzag(seq_lengths, cp)[c] if zigzag else _slices(n, cp)[c]
            self.rows = start + local
            self.cu_seqlens = torch.tensor([0] + torch.tensor(seq_lengths, dtype=torch.long).cumsum(0).tolist(),
                                           dtype=torch.int32)
            self.token_index = local if zigzag else None
            self.token_shape = (len(local),)
        else:
            cut = ROW_CUTS[dp]
            rows = torch.arange(cut[d], cut[d + 1])
            along = _zigzag([T], cp)[c] if zigzag else _slices(T, cp)[c]
            self.rows = (rows[:, None] * T + along[None, :]).reshape(-1)
            self.cu_seqlens = None
            self.token_index = along if zigzag else None
            self.token_shape = (len(rows), len(along))
        self.batch = batch

    def take(self, t):
        """Global per-token tensor ([N] or [B, T, ...]) -> this rank's, shaped like its share."""
        if t is None:
            return None
        flat = t.reshape(-1, *t.shape[(2 if self.batch.padded else 1):])
        return flat[self.rows].reshape(*self.token_shape, *flat.shape[1:]).clone()


def _check_split(rank, world, tp, dp, cp, layout, zigzag, dtype_name, entry, num_configs, vaco=False):
    import rlkernels
    from rlkernels.stage.metrics import KINDS  # noqa: F401  (imported to fail early if the module moved)

    from ..cases import assert_close, make_batch, scaled, seeded_config, tol

    dtype = getattr(torch, dtype_name)
    groups = _make_groups(tp, dp, cp)
    tp_group, dp_group, cp_group = (groups.get(k) for k in ("tp", "dp", "cp"))
    d, c, t = _coords(rank, tp, cp)
    sizes = [V // tp + (1 if r < V % tp else 0) for r in range(tp)]
    lo = sum(sizes[:t])
    hi = lo + sizes[t]
    rng = random.Random(1234 + 17 * world + len(layout))
    quantity = "same_path" if dtype == torch.float64 else "reordered"
    counter = Collectives("all_gather", "all_reduce", labels={g: k for k, g in groups.items()})
    world_group = counter.real["all_gather"]

    vaco_dropped = 0.0
    for case in range(scaled(num_configs)):  # the thorough profile draws ten times as many
        mode = rng.choice(["decoupled", "bypass", "on-policy"]) if entry != "correction" else "decoupled"
        if vaco:  # VACO in every case: its per-sequence divergence needs the training policy and the sampler
            mode = rng.choice(["decoupled", "bypass"])
        config = seeded_config(rng, mode, split="cp" if cp > 1 else "dp", backend="torch")
        while entry == "correction" and config.rollout_correction is None:  # rollout_correction needs one
            config = seeded_config(rng, mode, split="cp" if cp > 1 else "dp", backend="torch")
        if vaco and config.loss_type != "geo_mean":
            config = config.with_overrides(vaco_threshold=rng.choice([0.01, 0.05]),
                                           vaco_divergence=rng.choice(["tv", "kl"]))
        if entry == "compiled":  # the stage under torch.compile: the collectives are graph breaks
            config = config.with_overrides(compile_stage=True)
        lengths = LENGTHS if layout == "packed" else [T] * B
        batch = make_batch(layout, lengths, V, dtype=dtype, seed=100 + case, mask_p=0.8)
        if layout == "packed":  # an all-masked sequence
            batch.response_mask[sum(LENGTHS[:3]):sum(LENGTHS[:4])] = False
        share = _Share(batch, layout, d, c, dp, cp, zigzag)
        kw = batch.kwargs(mode)
        mine_kw = {k: (share.take(v) if k != "cu_seqlens" else share.cu_seqlens) for k, v in kw.items()}
        split_kw = dict(tp_group=tp_group, dp_group=dp_group, cp_group=cp_group, token_index=share.token_index)
        expected, got, grads = _run(rlkernels, entry, batch, share, kw, mine_kw, config, split_kw, lo, hi, counter)

        # collectives of the call just made: all_gathers only, none in the backward
        calls = dict(counter.calls)
        budget = {("all_gather", "tp"): 1 if tp > 1 else 0, ("all_gather", "dp"): 2 if dp > 1 else 0,
                  ("all_gather", "cp"): 0 if cp == 1 else (2 if (zigzag and layout == "packed") else 3)}
        if entry in ("correction", "policy"):
            budget[("all_gather", "tp")] = 0
        if entry == "linear" and tp > 1:
            budget[("all_reduce", "tp")] = 1
        if entry == "linear":  # tp_group, and bypass mode on a split, keep two passes (SPEC §2.1)
            two_pass = tp > 1 or (mode == "bypass" and (dp > 1 or cp > 1))
            assert got.path == ("linear_two_pass" if two_pass else expected.path), (case, mode, got.path)
        budget = {k: v for k, v in budget.items() if v}
        assert calls == budget, f"case {case}: collectives {calls}, expected {budget}"
        S = len(LENGTHS) if layout == "packed" else B
        for kind in ("dp", "cp"):  # bytes: sequences and metrics, not tokens
            sent = counter.sent.get(("all_gather", kind), 0)
            assert sent <= 8 * (1 + 12 * S + 3 * len(expected.metrics) + 8), f"{kind} sent {sent} bytes"

        if vaco:
            vaco_dropped = max(vaco_dropped, float(expected.metrics.get("actor/vaco_masked_fraction", 0.0)))
        reported = {name: value for name, value in expected.metrics.items()
                    if not (dp_group is not None and name in NOT_ON_DATA_PARALLEL_SPLITS)}
        for name, value in reported.items():
            scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
            assert_close(got.metrics[name], value, **tol(quantity, dtype, scale=scale), name=f"case {case}: {name}")
        assert set(got.metrics) == set(reported)
        assert torch.equal(got.mask, share.take(expected.mask)), f"case {case}: final mask"
        weights = expected.weights if entry == "correction" else expected.is_weights
        if weights is not None:
            assert_close(got.weights if entry == "correction" else got.is_weights, share.take(weights),
                         **tol(quantity, dtype), name=f"case {case}: IS weights")
        if entry != "correction":
            assert_close(got.logprobs, share.take(expected.logprobs), **tol(quantity, dtype), name="logprobs")
        # every rank holds the same metrics, bit for bit
        mine = torch.stack([got.metrics[n].double() for n in sorted(got.metrics)]) if got.metrics else torch.zeros(0)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        world_group(everyone, mine)
        assert all(torch.equal(everyone[0], other) for other in everyone), f"case {case}: ranks' metrics differ"
        if entry == "correction":
            continue
        # losses: summed over context-parallel ranks, averaged over data-parallel ones
        losses = [torch.empty(1, dtype=torch.float64) for _ in range(world)]
        world_group(losses, got.loss.detach().double().reshape(1))
        total = sum(float(losses[r]) for r in range(world) if _coords(r, tp, cp)[2] == 0) / dp
        scale = max(1.0, abs(float(expected.loss)))
        assert_close(torch.tensor(total), expected.loss.detach().double().cpu(),
                     **tol(quantity, dtype, scale=scale), name=f"case {case}: loss")
        for name, (g, want) in grads.items():
            want = want * dp
            g_scale = max(1e-3, float(want.abs().max())) if want.numel() else 1.0
            assert_close(g, want, **tol(quantity if dtype == torch.float64 else "reordered.dlogits", dtype,
                                        scale=g_scale), name=f"case {case}: {name}")
    counter.restore()
    assert not vaco or vaco_dropped > 0, "VACO dropped no token in any case: the split's sums went untested"


def _grads(loss, inputs):
    """d loss / d inputs, zeros for an input the loss does not use (the entropy without entropy_coeff)."""
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def _run(rlkernels, entry, batch, share, kw, mine_kw, config, split_kw, lo, hi, counter):
    """(expected on the whole batch, this rank's output, {name: (its gradient, the expected rows)})."""
    if entry == "correction":
        rc = config.rollout_correction
        train = batch.old_logprobs
        expected = rlkernels.rollout_correction(train, batch.rollout_logprobs, batch.response_mask,
                                                cu_seqlens=batch.cu_seqlens, config=rc)
        split_kw = {k: v for k, v in split_kw.items() if k != "tp_group"}
        counter.reset()
        got = rlkernels.rollout_correction(share.take(train), share.take(batch.rollout_logprobs),
                                           share.take(batch.response_mask), cu_seqlens=share.cu_seqlens,
                                           config=rc, **split_kw)
        return expected, got, {}
    if entry == "policy":
        lp = (batch.old_logprobs + 0.05 * torch.sin(torch.arange(batch.old_logprobs.numel()))
              .reshape(batch.old_logprobs.shape).to(batch.old_logprobs.dtype))
        ent = 1.5 + torch.cos(torch.arange(lp.numel())).reshape(lp.shape).to(lp.dtype)
        full = [lp.clone().requires_grad_(True), ent.clone().requires_grad_(True)]
        expected = rlkernels.policy_loss(full[0], batch.advantages, batch.response_mask, entropy=full[1],
                                         config=config, **kw)
        want = _grads(expected.loss, full)
        split_kw = {k: v for k, v in split_kw.items() if k != "tp_group"}
        mine = [share.take(lp).requires_grad_(True), share.take(ent).requires_grad_(True)]
        counter.reset()
        got = rlkernels.policy_loss(mine[0], share.take(batch.advantages), share.take(batch.response_mask),
                                    entropy=mine[1], config=config, **mine_kw, **split_kw)
        g = _grads(got.loss, mine)
        return expected, got, {"d logprobs": (g[0], share.take(want[0])), "d entropy": (g[1], share.take(want[1]))}
    if entry == "linear":
        H = 5
        gen = torch.Generator().manual_seed(5)
        hidden = torch.randn(*batch.labels.shape, H, generator=gen, dtype=torch.float64).to(batch.logits.dtype)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64).to(batch.logits.dtype)
        full = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        expected = rlkernels.linear_decoupled_ppo_loss(full[0], full[1], batch.labels, batch.advantages,
                                                       batch.response_mask, config=config, **kw)
        want = torch.autograd.grad(expected.loss, full)
        mine = [share.take(hidden).requires_grad_(True), weight[lo:hi].clone().requires_grad_(True)]
        args = (share.take(batch.labels), share.take(batch.advantages), share.take(batch.response_mask))
        if split_kw["tp_group"] is not None:  # learn the shard offsets (one cached all_gather) outside the count
            rlkernels.linear_token_logprobs(mine[0].detach(), mine[1].detach(), args[0], tp_group=split_kw["tp_group"])
        counter.reset()
        got = rlkernels.linear_decoupled_ppo_loss(mine[0], mine[1], *args, config=config, **mine_kw, **split_kw)
        g = torch.autograd.grad(got.loss, mine)
        # d_weight: this rank's rows' share; summed over the batch's ranks it is the whole gradient
        d_weight = g[1].clone()
        for kind in ("cp", "dp"):
            group = split_kw[f"{kind}_group"]
            if group is not None:
                parts = [torch.empty_like(d_weight) for _ in range(dist.get_world_size(group))]
                counter.real["all_gather"](parts, d_weight, group=group)
                d_weight = sum(parts) / (dist.get_world_size(group) if kind == "dp" else 1)
        dp = 1 if split_kw["dp_group"] is None else dist.get_world_size(split_kw["dp_group"])
        return expected, got, {"d hidden": (g[0], share.take(want[0])), "d weight": (d_weight, want[1][lo:hi] / dp)}
    # logits (entry "logits" or "compiled")
    full = batch.logits.clone().requires_grad_(True)
    # the expected side eager (for "compiled": compiled on the split against the eager stage on the whole batch)
    expected = rlkernels.decoupled_ppo_loss(full, batch.labels, batch.advantages, batch.response_mask,
                                            config=config.with_overrides(compile_stage=False), **kw)
    (want,) = torch.autograd.grad(expected.loss, full)
    mine = share.take(batch.logits)[..., lo:hi].clone().requires_grad_(True)
    args = (share.take(batch.labels), share.take(batch.advantages), share.take(batch.response_mask))
    if split_kw["tp_group"] is not None:  # learn the shard offsets (one cached all_gather) outside the count
        rlkernels.token_logprobs(mine.detach(), args[0], tp_group=split_kw["tp_group"])
    counter.reset()
    got = rlkernels.decoupled_ppo_loss(mine, *args, config=config, **mine_kw, **split_kw)
    (g,) = torch.autograd.grad(got.loss, mine)
    return expected, got, {"d logits": (g, share.take(want)[..., lo:hi])}


GRIDS = [
    # (tp, dp, cp, layout, zigzag, dtype, entry, configs)
    (1, 2, 1, "packed", False, "float64", "logits", 12),
    (1, 3, 1, "packed", False, "float64", "logits", 12),
    (1, 2, 1, "padded", False, "float64", "logits", 8),
    (1, 2, 1, "packed", False, "float32", "logits", 8),
    (1, 1, 2, "packed", False, "float64", "logits", 12),
    (1, 1, 3, "packed", False, "float64", "logits", 12),
    (1, 1, 2, "packed", True, "float64", "logits", 10),
    (1, 1, 3, "padded", False, "float64", "logits", 8),
    (1, 1, 2, "padded", True, "float32", "logits", 8),
    (1, 2, 2, "packed", True, "float64", "logits", 8),
    (2, 2, 1, "packed", False, "float64", "logits", 8),
    (2, 1, 2, "packed", False, "float64", "logits", 8),
    (2, 1, 2, "padded", True, "float32", "logits", 6),
    (2, 2, 1, "packed", False, "float64", "linear", 6),
    (1, 2, 2, "packed", False, "float64", "linear", 6),
    (1, 2, 1, "packed", False, "float64", "policy", 8),
    (1, 1, 3, "packed", True, "float64", "policy", 8),
    (1, 2, 2, "packed", False, "float64", "correction", 10),
    # one draw: each compiles ~7 graphs (the collectives break the stage) per rank, ~150 s of a cold Inductor
    # cache on 2 cores; the draws above cover the options, this one the compiled stage between collectives
    (1, 1, 2, "packed", True, "float32", "compiled", 1),
    (1, 1, 2, "padded", False, "float32", "correction", 8),
]


@pytest.mark.parametrize("tp,dp,cp,layout,zigzag,dtype_name,entry,num_configs", GRIDS,
                         ids=lambda v: str(v) if not isinstance(v, bool) else ("zigzag" if v else "slices"))
def test_split_batch_matches_the_single_process_computation(tp, dp, cp, layout, zigzag, dtype_name, entry,
                                                            num_configs, rank_pools):
    rank_pools(tp * dp * cp).run(_check_split, tp, dp, cp, layout, zigzag, dtype_name, entry, num_configs)


@pytest.mark.parametrize("dp,cp,layout", [(2, 1, "packed"), (1, 2, "packed"), (2, 2, "padded")])
def test_vaco_on_split_batches_matches_the_single_process_computation(dp, cp, layout, rank_pools):
    """VACO (SPEC §6.1) decides per sequence, from the mean divergence over its tokens in m': its sums are made
    whole across cp_group with the loss's other per-sequence sums, and a data-parallel rank's sequences are
    whole already. Every case sets vaco_threshold (its masked fraction is among the metrics compared)."""
    rank_pools(dp * cp).run(_check_split, 1, dp, cp, layout, False, "float64", "logits", 6, True)


def _check_errors(rank, world):
    import rlkernels
    from rlkernels import PolicyLossConfig

    from ..cases import make_batch

    group = dist.new_group(list(range(world)))
    batch = make_batch("packed", [4, 5], V, seed=3)
    rows = torch.arange(rank * 4, rank * 4 + 4)  # 4 tokens each, cu_seqlens says 9 in all
    args = (batch.logits[rows], batch.labels[rows], batch.advantages[rows], batch.response_mask[rows])
    config = PolicyLossConfig(backend="torch")
    with pytest.raises(ValueError, match="cu_seqlens.*all ranks of cp_group"):
        rlkernels.decoupled_ppo_loss(*args, cu_seqlens=batch.cu_seqlens, cp_group=group, config=config)
    # batch-global selections and the sequence ratio's second combine: refused, naming the option
    for option, match in ((dict(loss_type="clip_cov"), "loss_type: 'clip_cov' selects tokens over the whole batch"),
                          (dict(m2po_threshold=0.04), "m2po_threshold: 0.04 selects tokens over the whole batch"),
                          (dict(ratio_level="sequence"), "ratio_level: 'sequence' is not supported with cp_group")):
        with pytest.raises(ValueError, match=match):
            rlkernels.decoupled_ppo_loss(*args, cu_seqlens=batch.cu_seqlens, cp_group=group,
                                         config=config.with_overrides(**option))
    with pytest.raises(ValueError, match="token_index: expected global positions"):
        rlkernels.decoupled_ppo_loss(*args, cu_seqlens=batch.cu_seqlens, cp_group=group, config=config,
                                     token_index=rows + 6)  # positions 6..13 of 9: out of range on both ranks
    with pytest.raises(ValueError, match=r"token_index: expected shape \(4,\)"):
        rlkernels.decoupled_ppo_loss(*args, cu_seqlens=batch.cu_seqlens, cp_group=group, config=config,
                                     token_index=rows[:3])


def test_split_batch_errors_name_the_argument(rank_pools):
    rank_pools(2).run(_check_errors)


def test_group_arguments_are_checked_without_a_group():
    import rlkernels

    from ..cases import make_batch

    batch = make_batch("packed", [3], V, seed=1)
    args = (batch.logits, batch.labels, batch.advantages, batch.response_mask)
    with pytest.raises(ValueError, match="token_index: only used with cp_group"):
        rlkernels.decoupled_ppo_loss(*args, token_index=torch.arange(3))
    with pytest.raises(TypeError, match="dp_group: expected a torch.distributed ProcessGroup"):
        rlkernels.decoupled_ppo_loss(*args, dp_group="world")
    with pytest.raises(TypeError, match="cp_group: expected a torch.distributed ProcessGroup"):
        rlkernels.token_logprobs(batch.logits, batch.labels, cp_group=2)


def _check_one_gpu(rank, world):
    """On CUDA with NCCL: a one-rank dp_group / cp_group gives the ungrouped results, with the stage
    compiled (compile_stage=None compiles on CUDA) and the collectives as graph breaks."""
    import rlkernels

    from ..cases import assert_close, make_batch, seeded_config, tol

    rng = random.Random(7)
    for case in range(3):
        config = seeded_config(rng, "decoupled", split="dp", backend="auto")
        batch = make_batch("packed", LENGTHS, V, dtype=torch.float32, seed=case, mask_p=0.8)
        cuda = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch.kwargs("decoupled").items()}
        args = [t.cuda() for t in (batch.logits, batch.labels, batch.advantages, batch.response_mask)]
        want = rlkernels.decoupled_ppo_loss(*args, config=config, **cuda)
        for groups in (dict(dp_group=dist.group.WORLD), dict(cp_group=dist.group.WORLD)):
            got = rlkernels.decoupled_ppo_loss(*args, config=config, **cuda, **groups)
            assert_close(got.loss, want.loss, **tol("reordered", torch.float32), name=f"{groups}: loss")
            for name, value in want.metrics.items():
                if "dp_group" in groups and name in NOT_ON_DATA_PARALLEL_SPLITS:
                    assert name not in got.metrics
                    continue
                scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
                assert_close(got.metrics[name], value, **tol("reordered", torch.float32, scale=scale), name=name)


@pytest.mark.gpu
def test_split_batch_on_one_gpu_with_nccl():
    spawn(1, _check_one_gpu, backend="nccl")
