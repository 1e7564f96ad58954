"""optim.py against independent oracles: torch.optim.Muon, an SVD, hand-computed first
steps, explicit schedule tables, and single-process Muon for the sharded (FSDP2, torchrun)
path."""

import functools
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import optim
from config import (StackConfig, TrainConfig, WSDPhases, check_schedule, format_phases,
                    tiny_model, wsd_phases)
from optim import (Muon, Optimizers, build_optimizers, lr_multiplier, lr_scale, newton_schulz,
                   schedule_summary)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These matrices are tiny: on a busy 2-core machine, OpenMP threads waiting on each
    other made each small matmul ~1000x slower than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ---------------------------------------------------------------------------------------
# Newton–Schulz
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 20), (20, 48), (32, 32)])
def test_newton_schulz_equals_its_polynomial_on_the_singular_values(shape):
    """Oracle: the SVD. NS leaves U, V alone and maps each normalised singular value s
    through s -> a·s + b·s³ + c·s⁵ five times; in float64 the two must agree to rounding."""
    G = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    s = S / G.norm()
    for _ in range(5):
        s = 3.4445 * s - 4.7750 * s**3 + 2.0315 * s**5
    expected = U @ torch.diag(s) @ Vh
    torch.testing.assert_close(newton_schulz(G, 5, torch.float64), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 352), (13, 8)])
def test_newton_schulz_singular_values_lie_in_a_band_around_one(shape, dtype):
    """Jordan et al.'s coefficients stop short of exact orthogonality on purpose: for a
    well-conditioned (rectangular Gaussian) input every singular value ends in ~[0.68, 1.15]."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    O = newton_schulz(G, 5, dtype)
    assert O.dtype == G.dtype and O.shape == G.shape
    singular_values = torch.linalg.svdvals(O.double())
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25, singular_values


# ---------------------------------------------------------------------------------------
# Muon against torch.optim.Muon
# ---------------------------------------------------------------------------------------


def weight_change_after_10_steps(make_optimizer, shape):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape))  # O(1) weights: weight decay moves them visibly
    start = p.detach().clone()
    optimizer = make_optimizer([p])
    grads = torch.Generator().manual_seed(1)
    for _ in range(10):
        p.grad = torch.randn(shape, generator=grads)
        optimizer.step()
    return p.detach() - start


def test_stacked_newton_schulz_orthogonalises_each_matrix_on_its_own():
    """Muon orthogonalises same-shape matrices as one stack: a stack must equal the matrices
    one by one."""
    G = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(2))
    G[1] *= 100  # each matrix is normalised by its own norm, not the stack's
    stacked = newton_schulz(G)
    for i in range(3):
        torch.testing.assert_close(stacked[i], newton_schulz(G[i]), rtol=0, atol=1e-6)


def test_several_same_shape_matrices_match_torch_muon():
    """Three matrices of one shape (on a GPU Muon stacks them) and one of another, against
    torch.optim.Muon stepping each alone; same tolerance and reason as below."""
    torch.manual_seed(3)
    shapes = [(16, 24), (16, 24), (16, 24), (24, 8)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    opt_ours = Muon(ours, lr=0.02, weight_decay=0.1, adjust_lr="original")
    opt_theirs = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    grads = torch.Generator().manual_seed(4)
    for _ in range(10):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=grads)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b, s in zip(ours, theirs, start, strict=True):
        assert relative_error(a.detach() - s, b.detach() - s) < 0.02


def test_same_shape_matrices_are_bucketed_once_when_built():
    """Buckets hold positions in group["params"], found by shape in __init__, sorted by shape."""
    shapes = [(16, 24), (24, 8), (16, 24), (8, 8)]
    muon = Muon([torch.nn.Parameter(torch.zeros(s)) for s in shapes], lr=0.02)
    assert muon.shape_buckets == [(0, [3]), (0, [0, 2]), (0, [1])]


def test_each_bucket_is_orthogonalised_as_one_stack(monkeypatch):
    """Newton–Schulz runs once per shape, on the stack of that shape's matrices, on a CPU as
    on a GPU (a few large kernels in place of many small ones)."""
    seen = []
    monkeypatch.setattr(optim, "newton_schulz",
                        lambda G, *args: seen.append(tuple(G.shape)) or newton_schulz(G, *args))
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 24), (24, 8), (16, 24)]]
    muon = Muon(params, lr=0.02)
    for p in params:
        p.grad = torch.randn(p.shape)
    muon.step()
    assert sorted(seen) == [(1, 24, 8), (2, 16, 24)]


def test_step_follows_params_swapped_in_after_construction():
    """accelerate.prepare (FSDP2) replaces the tensors in group["params"] after the optimizer
    is built; the buckets are positions, so the step must update the new tensors."""
    muon = Muon([torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4, 8))],
                lr=0.02)
    swapped = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4, 8))]
    muon.param_groups[0]["params"] = swapped
    before = [p.detach().clone() for p in swapped]
    for p in swapped:
        p.grad = torch.randn(p.shape)
    muon.step()
    assert all(not torch.equal(p, b) for p, b in zip(swapped, before, strict=True))


def test_matrices_without_gradients_are_left_alone():
    moving, frozen = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    frozen_before = frozen.detach().clone()
    muon = Muon([moving, frozen], lr=0.02)
    moving.grad = torch.randn(8, 4)
    muon.step()
    assert torch.equal(frozen, frozen_before) and frozen not in muon.state


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_batched_buckets_match_matrix_by_matrix(device):
    """Each bucket is one stacked Newton–Schulz; in float32 it must match Muon stepping every
    matrix in a bucket of its own (different shapes never share a stack)."""
    shapes = [(64, 32), (64, 32), (64, 32), (32, 96)]
    torch.manual_seed(5)
    start = [torch.randn(s, device=device) for s in shapes]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(5)]

    def train(make_params):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        optimizers = [Muon(group, lr=0.02, ns_dtype=torch.float32) for group in make_params(params)]
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            for optimizer in optimizers:
                optimizer.step()
        return params

    batched = train(lambda ps: [ps])
    one_by_one = train(lambda ps: [[p] for p in ps])
    for a, b in zip(batched, one_by_one, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def relative_error(x, reference):
    return ((x - reference).norm() / reference.norm()).item()


# torch.optim.Muon always runs Newton–Schulz in bf16 (8-bit mantissa: 0.4% per rounding),
# ours on CPU in float32, so the two differ by bf16 rounding: measured 0.7% of the weight
# change over 10 steps. 2% leaves headroom, while real mistakes are 5-30x larger (the test
# below checks that a wrong momentum or no Nesterov would fail it).
ORACLE_TOLERANCE = 0.02


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("shape", [(64, 32), (32, 96)], ids=["tall", "wide"])
def test_muon_matches_torch_muon_after_10_steps(shape, adjust_lr):
    def oracle(params, **changes):
        settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                        adjust_lr_fn=adjust_lr) | changes
        return torch.optim.Muon(params, **settings)

    ours = weight_change_after_10_steps(
        lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, adjust_lr=adjust_lr), shape)
    reference = weight_change_after_10_steps(oracle, shape)
    assert relative_error(ours, reference) < ORACLE_TOLERANCE
    for mistake in (dict(momentum=0.9), dict(nesterov=False), dict(weight_decay=0.0)):
        wrong = weight_change_after_10_steps(lambda ps: oracle(ps, **mistake), shape)
        assert relative_error(wrong, reference) > 2 * ORACLE_TOLERANCE, mistake


def test_lr_scale_table():
    assert lr_scale(512, 1408, "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(1408))
    assert lr_scale(1408, 512, "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(1408))
    assert lr_scale(512, 512, "match_rms_adamw") == pytest.approx(4.5254834)
    assert lr_scale(1408, 512, "original") == pytest.approx(math.sqrt(1408 / 512))
    assert lr_scale(512, 1408, "original") == 1.0


def test_match_rms_adamw_gives_every_matrix_an_update_rms_of_0_2():
    """Moonlight's claim, checked: lr·0.2·sqrt(max(A, B))·O has RMS ≈ 0.2·lr for any shape."""
    for shape in [(128, 32), (32, 128), (64, 64)]:
        O = newton_schulz(torch.randn(shape, generator=torch.Generator().manual_seed(2)))
        rms = (lr_scale(*shape, "match_rms_adamw") * O).pow(2).mean().sqrt().item()
        assert 0.15 < rms < 0.21, (shape, rms)  # NS singular values sit a little below 1


def test_muon_refuses_what_it_cannot_optimise():
    with pytest.raises(ValueError, match="2-D matrices only"):
        Muon([torch.nn.Parameter(torch.ones(4))], lr=0.01)


def test_lr_scale_has_no_fallback_rule():
    """config.py owns the list of adjust_lr names; an unknown one must not silently get a
    formula (the old if/else gave anything but "original" Moonlight's)."""
    with pytest.raises(KeyError, match="rms"):
        lr_scale(4, 4, "rms")
    p = torch.nn.Parameter(torch.ones(4, 4))
    muon = Muon([p], lr=0.01, adjust_lr="rms")
    p.grad = torch.ones(4, 4)
    with pytest.raises(KeyError, match="rms"):
        muon.step()


def test_state_dict_round_trip_continues_bit_identically():
    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(24, 16))
        return p, Muon([p], lr=0.02)

    def steps(p, optimizer, seeds):
        for seed in seeds:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
            optimizer.step()

    p, optimizer = make()
    steps(p, optimizer, range(5))
    q, interrupted = make()
    steps(q, interrupted, range(3))
    buffer = io.BytesIO()
    torch.save({"p": q.detach(), "optimizer": interrupted.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    r, resumed = make()
    with torch.no_grad():
        r.copy_(saved["p"])
    resumed.load_state_dict(saved["optimizer"])
    assert resumed.state[r]["momentum_buffer"].abs().sum() > 0
    steps(r, resumed, range(3, 5))
    assert torch.equal(r, p)


# ---------------------------------------------------------------------------------------
# Parameter routing
# ---------------------------------------------------------------------------------------


class StandInModel(torch.nn.Module):
    """model.py's naming: embed (tied head), blocks[i].attn.{q,k,v,o}_proj and {q,k}_norm,
    blocks[i].mlp.{gate,up,down}_proj, pre-norms, final norm."""

    def __init__(self, vocab=64, d=16, kv=8, hidden=40, layers=2, head_dim=4):
        super().__init__()
        linear = functools.partial(torch.nn.Linear, bias=False)
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.attn_norm, block.mlp_norm = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
            block.attn = torch.nn.Module()
            block.attn.q_proj, block.attn.k_proj = linear(d, d), linear(d, kv)
            block.attn.v_proj, block.attn.o_proj = linear(d, kv), linear(d, d)
            block.attn.q_norm = torch.nn.RMSNorm(head_dim)
            block.attn.k_norm = torch.nn.RMSNorm(head_dim)
            block.mlp = torch.nn.Module()
            block.mlp.gate_proj, block.mlp.up_proj = linear(d, hidden), linear(d, hidden)
            block.mlp.down_proj = linear(hidden, d)
            self.blocks.append(block)
        self.norm = torch.nn.RMSNorm(d)
        self.head_weight = self.embed.weight  # tied: the same Parameter under a second name


def micro_transformer():
    """The real model.py at a toy size: same routing rule, its own parameter names."""
    import model
    return model.Transformer(StackConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4,
                                       n_kv_heads=2, intermediate=64, max_seq_len=32))


@pytest.mark.parametrize("make_model", [StandInModel, micro_transformer])
def test_every_trainable_parameter_is_in_exactly_one_group(make_model):
    model = make_model()
    optimizers = build_optimizers(model, TrainConfig())
    assert list(optimizers.named) == ["muon", "adamw"]
    groups = {(name, group["name"]): group for name, opt in optimizers.named.items()
              for group in opt.param_groups}
    owner = {}
    for key, group in groups.items():
        for p in group["params"]:
            assert id(p) not in owner, f"in {owner[id(p)]} and {key}"
            owner[id(p)] = key
    for name, p in model.named_parameters(remove_duplicate=False):
        expected = (("adamw", "embedding") if name in ("embed.weight", "head_weight")
                    else ("adamw", "gains") if "norm" in name else ("muon", "matrices"))
        assert owner[id(p)] == expected, name
    assert len(owner) == len(list(model.parameters()))


def test_groups_start_at_peak_lr_with_weight_decay_only_on_matrices():
    cfg = TrainConfig(muon_peak_lr=0.01, adamw_peak_lr=0.002, betas=(0.8, 0.9), weight_decay=0.05,
                      muon_adjust_lr="original")
    optimizers = build_optimizers(StandInModel(), cfg)
    muon, adamw = optimizers.named["muon"], optimizers.named["adamw"]
    (matrices,), (embedding, gains) = muon.param_groups, adamw.param_groups
    assert (matrices["lr"], matrices["weight_decay"]) == (0.01, 0.05)
    assert (matrices["momentum"], matrices["adjust_lr"]) == (0.95, "original")
    assert (embedding["lr"], embedding["weight_decay"]) == (0.002, 0.05)
    assert embedding["betas"] == (0.8, 0.9)
    assert (gains["lr"], gains["weight_decay"]) == (0.002, 0.0)
    assert len(matrices["params"]) == 2 * 7 and len(gains["params"]) == 2 * 4 + 1


def test_every_group_records_its_peak_lr():
    cfg = TrainConfig(muon_peak_lr=0.01, adamw_peak_lr=0.002)
    optimizers = build_optimizers(StandInModel(), cfg).named.values()
    assert [g["peak_lr"] for opt in optimizers for g in opt.param_groups] == [0.01, 0.002, 0.002]


def test_adamw_baseline_puts_the_matrices_in_adamw():
    """matrix_optimizer="adamw" (bench/recipe.py's baseline): same groups, no Muon, and no
    AdamW filed under the name "muon"."""
    cfg = TrainConfig(muon_peak_lr=0.01, adamw_peak_lr=0.002, matrix_optimizer="adamw")
    optimizers = build_optimizers(StandInModel(), cfg)
    assert list(optimizers.named) == ["adamw_matrices", "adamw"]
    assert all(type(opt) is torch.optim.AdamW for opt in optimizers.named.values())
    (matrices,) = optimizers.named["adamw_matrices"].param_groups
    assert (matrices["lr"], matrices["peak_lr"], matrices["weight_decay"]) == (0.002, 0.002, 0.1)
    assert matrices["betas"] == cfg.betas and len(matrices["params"]) == 2 * 7
    assert optimizers.summary().startswith("adamw matrices: 14 tensors")


def test_frozen_parameters_are_left_out():
    model = StandInModel()
    model.blocks[0].attn.q_proj.weight.requires_grad_(False)
    muon = build_optimizers(model, TrainConfig()).named["muon"]
    assert all(p is not model.blocks[0].attn.q_proj.weight for p in muon.param_groups[0]["params"])


def test_a_bf16_run_orthogonalises_in_bf16_and_any_other_takes_muons_default():
    """README: a bf16 run runs Newton–Schulz in bf16 (on a CPU too); an fp32 run leaves it
    to Muon (float32 on a CPU, bf16 on a GPU)."""
    for precision, want in (("bf16", torch.bfloat16), ("no", None)):
        muon = build_optimizers(StandInModel(), TrainConfig(), precision).named["muon"]
        assert muon.ns_dtype is want, precision


def test_summary_is_one_line_of_counts_and_numels():
    line = build_optimizers(StandInModel(), TrainConfig()).summary()
    matrices = 2 * (16 * 16 * 2 + 16 * 8 * 2 + 16 * 40 * 3)
    gains = 2 * (16 * 2 + 4 * 2) + 16
    assert line == (f"muon matrices: 14 tensors {matrices:,} params wd 0.1 | "
                    f"adamw embedding: 1 tensors 1,024 params wd 0.1 | "
                    f"adamw gains: 9 tensors {gains} params wd 0")


def test_summary_of_the_tiny_preset_is_the_banner_line():
    """The banner's text, byte for byte, for the default optimizer settings."""
    import model
    line = build_optimizers(model.Transformer(tiny_model()), TrainConfig()).summary()
    assert line == ("muon matrices: 28 tensors 2,949,120 params wd 0.1 | adamw embedding: "
                    "1 tensors 1,048,576 params wd 0.1 | adamw gains: 17 tensors 2,816 params wd 0")


# ---------------------------------------------------------------------------------------
# Optimizers: the pair, stepped as one
# ---------------------------------------------------------------------------------------


def forward_backward(model, seed=0):
    """A made-up loss that reaches every parameter of StandInModel: embedding, matrices and
    gains, so that every group of both optimizers has a gradient."""
    tokens = torch.randint(0, 64, (4,), generator=torch.Generator().manual_seed(seed))
    x = model.embed(tokens)  # (4, d)
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        h = block.attn_norm(x)
        q = attn.q_norm(attn.q_proj(h).unflatten(-1, (-1, 4)))  # (4, heads, head_dim)
        k = attn.k_norm(attn.k_proj(h).unflatten(-1, (-1, 4)))  # (4, kv heads, head_dim)
        x = x + attn.o_proj(h * (q.sum() + k.sum() + attn.v_proj(h).sum()))
        h = block.mlp_norm(x)
        x = x + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
    (model.norm(x) @ model.head_weight.T).square().mean().backward()


@pytest.mark.parametrize("matrix_optimizer", ["muon", "adamw"])
def test_set_lr_sets_peak_lr_times_multiplier_on_every_group(matrix_optimizer):
    cfg = TrainConfig(muon_peak_lr=0.01, adamw_peak_lr=0.002, matrix_optimizer=matrix_optimizer)
    optimizers = build_optimizers(StandInModel(), cfg)
    optimizers.set_lr(0.25)
    groups = [g for opt in optimizers.named.values() for g in opt.param_groups]
    assert len(groups) == 3
    assert all(g["lr"] == g["peak_lr"] * 0.25 for g in groups)
    matrix_lr = (0.01 if matrix_optimizer == "muon" else 0.002) * 0.25
    assert list(optimizers.lrs().values()) == [matrix_lr, 0.002 * 0.25]


def test_lrs_reports_each_optimizers_first_group_in_order():
    w = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    optimizers = Optimizers({
        "second": torch.optim.SGD([dict(params=[w[0]], lr=0.1), dict(params=[w[1]], lr=0.2)]),
        "first": torch.optim.SGD([w[2]], lr=0.3)})
    assert list(optimizers.lrs().items()) == [("second", 0.1), ("first", 0.3)]


def test_step_steps_both_and_zero_grad_clears_both():
    model = StandInModel()
    optimizers = build_optimizers(model, TrainConfig())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    forward_backward(model)
    optimizers.step()
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert moved == set(before), set(before) - moved  # Muon's matrices and AdamW's the rest
    optimizers.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_first_step_of_each_optimizer_equals_hand_math():
    """Oracle: the first step in closed form, at lr = peak_lr·multiplier after set_lr.
    AdamW (bias-corrected, zero state): W·(1 − lr·wd) − lr·g/(|g| + eps). Muon (zero momentum):
    the Nesterov update is a multiple of g, and Newton–Schulz ignores the scale, so
    W·(1 − lr·wd) − lr·0.2·sqrt(max(A, B))·NewtonSchulz(g)."""
    cfg = TrainConfig(muon_peak_lr=0.01, adamw_peak_lr=0.002, weight_decay=0.1)
    model = StandInModel()
    optimizers = build_optimizers(model, cfg)
    optimizers.set_lr(0.5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    forward_backward(model)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizers.step()
    for name, p in model.named_parameters():
        w, g = before[name], grads[name]
        if p is model.embed.weight or "norm" in name:
            lr, wd = 0.002 * 0.5, (0.0 if "norm" in name else 0.1)
            expected = w * (1 - lr * wd) - lr * g / (g.abs() + 1e-8)
        else:
            lr = 0.01 * 0.5
            step = 0.2 * math.sqrt(max(w.shape)) * newton_schulz(g)
            expected = w * (1 - lr * 0.1) - lr * step
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6,
                                   msg=lambda detail: f"{name}: {detail}")


def test_adamw_baseline_equals_torch_adamw_on_the_same_groups():
    """Oracle: the all-AdamW baseline, stepped through Optimizers with a changing lr, equals
    one torch.optim.AdamW over the same three groups driven by hand."""
    cfg = TrainConfig(adamw_peak_lr=0.002, matrix_optimizer="adamw")
    ours, reference = StandInModel(), StandInModel()
    reference.load_state_dict(ours.state_dict())
    optimizers = build_optimizers(ours, cfg)
    twin = {id(a): b for a, b in zip(ours.parameters(), reference.parameters(), strict=True)}
    groups = [dict(params=[twin[id(p)] for p in group["params"]],
                   weight_decay=group["weight_decay"])
              for opt in optimizers.named.values() for group in opt.param_groups]
    oracle = torch.optim.AdamW(groups, lr=0.002, betas=cfg.betas)
    for step, multiplier in enumerate([0.25, 0.5, 1.0]):
        optimizers.set_lr(multiplier)
        for group in oracle.param_groups:
            group["lr"] = 0.002 * multiplier
        forward_backward(ours, seed=step)
        forward_backward(reference, seed=step)
        optimizers.step()
        oracle.step()
        optimizers.zero_grad()
        oracle.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda detail: f"{name}: {detail}")


# ---------------------------------------------------------------------------------------
# WSD schedule
# ---------------------------------------------------------------------------------------


def test_reference_phases():
    full = TrainConfig(total_steps=38_147, stop_at_step=38_147)
    assert wsd_phases(full) == WSDPhases(warmup_steps=2_000, stable_steps=32_332,
                                         decay_steps=3_815, decay_start=34_332)
    assert format_phases(wsd_phases(full)) == "2,000 warmup / 32,332 stable / 3,815 decay"
    short = TrainConfig(total_steps=34_332, stop_at_step=34_332)
    assert format_phases(check_schedule(short)) == "2,000 warmup / 28,899 stable / 3,433 decay"
    assert schedule_summary(TrainConfig()) == ("2,000 warmup / 32,332 stable / 3,815 decay "
                                               "(decay starts at step 34,332, sqrt)")


def test_stack100m_stable_phase_run_never_leaves_peak():
    cfg = TrainConfig()  # total 38,147, stop at 34,332: the decay leg is never reached
    assert check_schedule(cfg) == WSDPhases(2_000, 32_332, 3_815, 34_332)
    assert all(lr_multiplier(step, cfg) == 1.0 for step in range(2_000, cfg.stop_at_step))
    assert lr_multiplier(0, cfg) == 1 / 2_000 and lr_multiplier(1_999, cfg) == 1.0


def tiny_schedule(**changes):
    settings = dict(total_steps=10, stop_at_step=10, warmup_steps=2, decay_steps=4,
                    decay_shape="linear", final_frac=0.0) | changes
    return TrainConfig(**settings)


# Warmup is (step+1)/warmup: step 0 already trains. Decay progress is (step-decay_start)/decay,
# the mirror image: the first decay step is still at peak, the last at shape((D-1)/D), and
# final_frac is reached one step after the run, so no step trains at lr 0.
SCHEDULE_TABLES = {
    #         step:  0    1    2    3    4    5    6    7       8       9       10 (past the end)
    "linear": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0],
    "sqrt": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.2928932, 0.1339746, 0.0],
    "cosine": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8535534, 0.5, 0.1464466, 0.0],
}


@pytest.mark.parametrize("shape", sorted(SCHEDULE_TABLES))
def test_schedule_step_by_step_table(shape):
    cfg = tiny_schedule(decay_shape=shape)
    got = [lr_multiplier(step, cfg) for step in range(11)]
    assert got == pytest.approx(SCHEDULE_TABLES[shape], abs=1e-7)


def test_decay_ends_at_final_frac():
    cfg = tiny_schedule(final_frac=0.1)
    got = [lr_multiplier(step, cfg) for step in range(6, 12)]
    assert got == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1, 0.1])


def test_explicit_decay_start_moves_the_leg():
    cfg = tiny_schedule(total_steps=12, stop_at_step=9, decay_start=5)
    assert check_schedule(cfg) == WSDPhases(2, 3, 4, 5)
    got = [lr_multiplier(step, cfg) for step in range(4, 10)]
    assert got == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_refuses_a_run_that_would_stop_mid_decay():
    """Refused when the config is made (TrainConfig validates its schedule), not later."""
    with pytest.raises(ValueError, match=r"stop_at_step=36,000 is inside the decay leg .*"
                       r"2,000 warmup / 32,332 stable / 3,815 decay.*set decay_start=34,332 "
                       r"explicitly if intended, or stop_at_step=34,332"):
        TrainConfig(total_steps=38_147, stop_at_step=36_000)
    check_schedule(TrainConfig(total_steps=38_147, stop_at_step=36_000, decay_start=34_332))


def test_the_mid_decay_refusal_starts_one_step_past_the_decay_start():
    """The edge: the reference run stops exactly where the decay leg starts (34,332), which
    is allowed; one step later is inside the leg, which is refused."""
    assert TrainConfig(total_steps=38_147, stop_at_step=34_332).stop_at_step == 34_332
    with pytest.raises(ValueError, match="stop_at_step=34,333 is inside the decay leg"):
        TrainConfig(total_steps=38_147, stop_at_step=34_333)


def test_refuses_warmup_and_decay_longer_than_the_run():
    with pytest.raises(ValueError, match=r"2,000 \+ 1,500 exceed total_steps=3,000"):
        TrainConfig(total_steps=3_000, stop_at_step=3_000, warmup_steps=2_000,
                    decay_fraction=0.5)


def test_refuses_a_decay_leg_outside_the_run():
    with pytest.raises(ValueError, match="decay_start=1 does not fit"):
        check_schedule(tiny_schedule(decay_start=1))
    with pytest.raises(ValueError, match="decay_start=8 does not fit.*between 2 and 6"):
        check_schedule(tiny_schedule(decay_start=8))


def test_a_full_run_that_decays_at_its_end_is_fine():
    assert check_schedule(TrainConfig(stop_at_step=38_147)).decay_start == 34_332


# ---------------------------------------------------------------------------------------
# Sharded Muon under torchrun (FSDP2, gloo, CPU)
# ---------------------------------------------------------------------------------------


def torchrun(nproc, action, ckpt_dir, out_json):
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
               str(ROOT / "tests" / "dist_muon.py"), action, str(ckpt_dir), str(out_json)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(Path(out_json).read_text())


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """2 ranks train and save a checkpoint after step 3; 3 ranks train and also resume it."""
    tmp = tmp_path_factory.mktemp("dist_muon")
    return {2: torchrun(2, "save", tmp / "ckpt", tmp / "two.json"),
            3: torchrun(3, "resume", tmp / "ckpt", tmp / "three.json")}


# Largest relative weight error of the real code against single-process Muon, measured on
# this machine: 0.0 (bitwise) at 2 ranks; 3.0e-6 at 3 ranks, because FSDP's average of the
# ranks' identical fp32 gradients, (g + g + g) / 3, is 1 ulp off g in ~15% of entries (with
# the reference fed that same average the 3-rank error is 0.0 too) and 5 Newton-Schulz steps
# grow it; 8.1e-7 resumed. The tolerance is >= 10x each (16x the largest); every negative
# control (0.15 to 0.39) lands >= 10x above it.
SHARDED_MUON_TOL = 5e-5


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_muon_equals_single_process_muon(sharded_runs, world_size):
    """Rows 13 and 2 do not split evenly over the ranks. The negative control, which
    orthogonalises local shards only, is off by tens of percent (0.37 at 2 ranks, 0.39 at
    3): the test can tell."""
    result = sharded_runs[world_size]
    assert result["muon"] < SHARDED_MUON_TOL, result
    assert result["local_shard_muon"] > 10 * SHARDED_MUON_TOL, result


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_muon_makes_two_collectives_per_matrix_shape(sharded_runs, world_size):
    """The matrices of a shape go to their owners and back in one all-to-all each way: a
    step's collectives grow with the distinct shapes (5 here), not the matrices (10; one
    gather and one scatter for each was 20)."""
    result = sharded_runs[world_size]
    assert (result["matrices"], result["shapes"]) == (10, 5), result
    assert result["collectives"] == 2 * result["shapes"], result


def all_to_all_bytes(world: int, itemsize: int) -> int:
    """What one rank sends in a step of dist_muon.py's model, by plain arithmetic: per
    shape (two matrices each), two all-to-alls of ceil(2 / W) slots x W pieces of
    ceil(rows / W) rows."""
    shapes = [(20, 8), (8, 20), (13, 8), (8, 13), (2, 8)]
    return sum(2 * -(-2 // world) * world * -(-rows // world) * cols * itemsize
               for rows, cols in shapes)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_muon_sends_bf16_pieces_when_newton_schulz_runs_in_bf16(sharded_runs,
                                                                       world_size):
    """With Newton–Schulz in bf16 the all-to-alls carry bf16 both ways, half the bytes of
    fp32 pieces, and the weights end bitwise where sending fp32 (and casting on arrival)
    leaves them: Newton–Schulz casts to bf16 first either way. Against single-process Muon
    in bf16, which never sends a piece: bitwise at 2 ranks, as in fp32; measured 0.0 at 3
    ranks too, held to the fp32 tolerance (a double rounding on the way, through fp16 then
    bf16, is off by far more)."""
    result = sharded_runs[world_size]
    assert result["bf16_muon"] == 0.0 if world_size == 2 else \
        result["bf16_muon"] < SHARDED_MUON_TOL, result
    assert result["traffic_dtypes"] == ["torch.bfloat16"], result
    assert result["fp32_traffic_dtypes"] == ["torch.float32"], result
    assert result["traffic_bytes"] == all_to_all_bytes(world_size, 2), result
    assert result["fp32_traffic_bytes"] == all_to_all_bytes(world_size, 4), result
    assert result["bf16_against_fp32_traffic"] == 0.0, result


@pytest.mark.distributed
def test_sharded_checkpoint_reloads_on_another_number_of_ranks(sharded_runs):
    """Saved at 2 ranks, resumed at 3. The negative control reloads only the weights, so Muon
    restarts from zero momentum: off by 0.15, so the momentum buffers are really restored."""
    result = sharded_runs[3]
    assert result["resumed"] < SHARDED_MUON_TOL, result
    assert result["resumed_without_momentum"] > 10 * SHARDED_MUON_TOL, result
