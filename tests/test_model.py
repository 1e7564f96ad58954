"""Tests for model.py and sample.py, each against an independent oracle: F.cross_entropy on
full logits, SDPA run per document, explicit per-head loops, F.rms_norm, FlopCounterMode,
published parameter and FLOP figures, and no-cache decoding."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import config
import model as M
from conftest import KeptForBackward
from plumbing import overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_cfg(**overrides) -> config.StackConfig:
    """Two RoPE layers and two NoPE layers (nope_every=2), GQA 4:2, ~40k parameters."""
    shape = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                 intermediate=64, max_seq_len=64, nope_every=2, ce_chunk_size=7)
    return config.StackConfig(**{**shape, **overrides})


def small_model(seed=0, **overrides) -> M.Transformer:
    torch.manual_seed(seed)
    return M.Transformer(small_cfg(**overrides))


# ---------------------------------------------------------------------------------------
# The loss: plainly, and the model's two heads (the chunked one: test_loss.py)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reference_loss_is_cross_entropy_plus_z_loss_by_hand(reduction):
    """Plain math: rows (0, ln 3) → target 1 and (ln 2, 0) → target 0 have softmax
    probabilities 3/4 and 2/3, so CE = ln 4/3 + ln 3/2 = ln 2, and logsumexp ln 4 and ln 3;
    the third row is ignored. Differentiable through `loss` only."""
    logits = torch.tensor([[0.0, math.log(3)], [math.log(2), 0.0], [5.0, -5.0]],
                          dtype=torch.float64, requires_grad=True)
    loss, ce, z = M.reference_loss(logits, torch.tensor([1, 0, -100]), 0.1, reduction=reduction)
    n = 2 if reduction == "mean" else 1
    assert ce.item() == pytest.approx(math.log(2) / n, rel=1e-12)
    assert z.item() == pytest.approx(0.1 * (math.log(4) ** 2 + math.log(3) ** 2) / n, rel=1e-12)
    assert loss.item() == pytest.approx(ce.item() + z.item(), rel=1e-12)
    assert loss.requires_grad and not ce.requires_grad and not z.requires_grad
    grad, = torch.autograd.grad(loss, logits)
    assert grad[2].abs().max() == 0  # the ignored row


def test_model_loss_parts_and_tied_gradient_match_full_logits():
    model = small_model()
    ids = torch.randint(0, 97, (2, 12))
    targets = torch.randint(0, 97, (2, 12))
    targets[0, :3] = -100
    loss, ce, z = model(ids, targets=targets, reduction="sum")
    loss.backward()
    grad = model.embed.weight.grad.clone()
    model.zero_grad()
    # Oracle: all logits from the same model, the reference loss, and autograd through both
    # uses of the tied matrix (lookup and head).
    logits = model.logits(ids)
    ref = M.reference_loss(logits.flatten(0, 1), targets.flatten(), model.cfg.z_loss,
                           reduction="sum")
    ref.loss.backward()
    torch.testing.assert_close(ce, ref.ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z, ref.z, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.detach(), ce + z)
    torch.testing.assert_close(grad, model.embed.weight.grad, rtol=1e-5, atol=1e-6)
    mean_loss = model(ids, targets=targets).loss
    torch.testing.assert_close(mean_loss.detach(), loss.detach() / 21)  # 24 - 3 ignored


def test_the_plain_head_is_cross_entropy_on_the_logits_and_equals_the_chunked_one(monkeypatch):
    """ce_chunk_size 0: forward builds the logits and takes F.cross_entropy + z·lse² of them
    (the oracle, written here from torch's functions), PLAIN_ROWS rows at a time (5 here,
    not dividing the 24 rows), never the chunked head; the chunked head on the same weights
    gives the same loss and tied gradient."""
    ids, targets = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    targets[1, 3:7] = -100  # ignored rows inside a chunk, not the last chunk's
    plain, chunked = small_model(ce_chunk_size=0), small_model(ce_chunk_size=7)
    monkeypatch.setattr(M, "PLAIN_ROWS", 5)
    with monkeypatch.context() as m:
        m.setattr(M, "fused_ce_z_loss", lambda *a, **k: pytest.fail("chunked head called"))
        loss, ce, z = plain(ids, targets=targets)
    loss.backward()
    logits = plain.logits(ids).flatten(0, 1).detach()
    kept = targets.flatten() != -100
    want_ce = F.cross_entropy(logits, targets.flatten(), ignore_index=-100)
    want_z = plain.cfg.z_loss * logits.logsumexp(-1)[kept].square().mean()
    torch.testing.assert_close(ce, want_ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, want_z, rtol=1e-6, atol=1e-9)
    other = chunked(ids, targets=targets)
    other.loss.backward()
    torch.testing.assert_close(other.loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.embed.weight.grad, plain.embed.weight.grad, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("ce_chunk_size", [0, 7])  # the plain head, the chunked one
@pytest.mark.parametrize("gain", [1e5, 1e16])
def test_the_loss_stays_exact_for_logits_far_beyond_exps_range(ce_chunk_size, gain):
    """Either head, with logits scaled by the final norm's gain to ~1e4 and ~1e15 (exp
    overflows fp32 past 88): the loss is finite and is the float64 oracle's, CE + z·lse²
    from torch.logsumexp of the model's own fp32 logits, and every gradient is finite.
    (Past √(fp32's max) ≈ 1.8e19, lse² itself would overflow.)"""
    model = small_model(ce_chunk_size=ce_chunk_size)
    ids, targets = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    targets[1, -4:] = -100
    with torch.no_grad():
        model.norm.weight.fill_(gain)
    loss, ce, z = model(ids, targets=targets)
    loss.backward()
    logits = model.logits(ids).flatten(0, 1).double()  # (N, V), fp32 values
    kept = targets.flatten() != -100
    lse = logits.logsumexp(-1)[kept]
    want_ce = (lse - logits[kept].gather(1, targets.flatten()[kept, None]).squeeze(1)).mean()
    want_z = model.cfg.z_loss * lse.square().mean()
    assert logits.abs().max() > gain / 10  # far beyond exp's range indeed
    assert ce.item() == pytest.approx(want_ce.item(), rel=1e-5)
    assert z.item() == pytest.approx(want_z.item(), rel=1e-5)
    assert loss.item() == pytest.approx((want_ce + want_z).item(), rel=1e-5)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_plain_head_runs_in_the_blocks_precision_and_its_loss_in_fp32():
    """Under bf16 autocast (a CPU or GPU run in bf16) the plain head's matmul runs in bf16,
    as the blocks' do (and nanoGPT's head), and the loss takes its logits in fp32. Oracle:
    reference_loss on the same hidden states through a bf16 matmul, upcast; the fp32 head
    differs from it by bf16's rounding of the logits, here ~1e-5 relative."""
    model = small_model(ce_chunk_size=0)
    ids, targets = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, targets=targets).loss
        hidden = model.hidden_states(ids, None, None).flatten(0, 1)  # (N, C)
    assert loss.dtype == torch.float32
    bf16_logits = (hidden.bfloat16() @ model.embed.weight.bfloat16().T).float()
    want = M.reference_loss(bf16_logits, targets.flatten(), model.cfg.z_loss).loss
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    fp32 = M.reference_loss(hidden.float() @ model.embed.weight.T, targets.flatten(),
                            model.cfg.z_loss).loss
    assert 0 < abs(float(loss - fp32) / float(fp32)) < 1e-3


def test_the_embedding_is_the_only_vocab_matrix():
    model = small_model()
    vocab_sized = [name for name, p in model.named_parameters() if 97 in p.shape]
    assert vocab_sized == ["embed.weight"]


# ---------------------------------------------------------------------------------------
# Attention: backend choice, document masking, GQA, RoPE / NoPE, QK-norm
# ---------------------------------------------------------------------------------------


def test_attention_backend_choice():
    assert M.attention_backend(torch.device("cpu"), has_seq_ids=False) == "sdpa_causal"
    assert M.attention_backend(torch.device("cpu"), has_seq_ids=True) == "sdpa_dense"
    assert M.attention_backend(torch.device("cuda"), has_seq_ids=True) == "flex"
    assert M.attention_backend(torch.device("cuda"), has_seq_ids=False) == "sdpa_causal"
    seq_ids = torch.tensor([[0, 0, 1, 1]])
    assert M.attention_mask(None, torch.device("cpu")) is None
    assert M.attention_mask(seq_ids, torch.device("cpu")).dtype == torch.bool


def explicit_attention(q, k, v, allowed):
    """Per query head, by hand: head h reads kv head h // (H / K). allowed (B, T, S) bool."""
    H, K = q.shape[1], k.shape[1]
    heads = []
    for h in range(H):
        kv = h // (H // K)
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, T, S)
        scores = scores.masked_fill(~allowed, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, kv])  # (B, T, D)
    return torch.stack(heads, dim=1)  # (B, H, T, D)


def test_gqa_attention_matches_explicit_per_head_loop():
    torch.manual_seed(0)
    B, H, K, T, D = 2, 6, 2, 9, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, K, T, D), torch.randn(B, K, T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    torch.testing.assert_close(M.attention(q, k, v, None), explicit_attention(q, k, v, causal))
    seq_ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 2 + [1] * 3 + [2] * 4])
    mask = M.document_dense_mask(seq_ids)
    allowed = causal & (seq_ids[:, :, None] == seq_ids[:, None, :])
    torch.testing.assert_close(M.attention(q, k, v, mask), explicit_attention(q, k, v, allowed))


def test_dense_document_mask_equals_per_document_causal_sdpa():
    torch.manual_seed(0)
    B, H, K, T, D = 2, 4, 2, 12, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, K, T, D), torch.randn(B, K, T, D)
    bounds = [[0, 5, 12], [0, 3, 4, 12]]  # documents' starts; a length-1 document in row 1
    seq_ids = torch.zeros(B, T, dtype=torch.long)
    for b, edges in enumerate(bounds):
        for doc, (lo, hi) in enumerate(zip(edges, edges[1:])):
            seq_ids[b, lo:hi] = doc
    out = M.attention(q, k, v, M.document_dense_mask(seq_ids))
    for b, edges in enumerate(bounds):
        for lo, hi in zip(edges, edges[1:]):
            alone = F.scaled_dot_product_attention(
                q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi].repeat_interleave(H // K, 1),
                v[b:b + 1, :, lo:hi].repeat_interleave(H // K, 1), is_causal=True)
            torch.testing.assert_close(out[b:b + 1, :, lo:hi], alone)


def test_packed_documents_equal_each_document_alone():
    model = small_model()
    doc_a, doc_b = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 7))
    packed = torch.cat([doc_a, doc_b], dim=1)  # (1, 12)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    seq_ids = torch.tensor([[0] * 5 + [1] * 7])
    logits = model.logits(packed, position_ids=position_ids, seq_ids=seq_ids)
    alone_a = model.logits(doc_a)
    alone_b = model.logits(doc_b)
    torch.testing.assert_close(logits[:, :5], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, 5:], alone_b, rtol=1e-5, atol=1e-5)
    # Without seq_ids, B's tokens see A: the mask is what makes them equal.
    leaky = model.logits(packed, position_ids=position_ids)
    assert (leaky[:, 5:] - alone_b).abs().max() > 1e-3


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        cos_m, sin_m = M.rope_cos_sin(torch.tensor([[m]]), 16, 10000.0)
        cos_n, sin_n = M.rope_cos_sin(torch.tensor([[n]]), 16, 10000.0)
        return (M.apply_rope(q, cos_m, sin_m) * M.apply_rope(k, cos_n, sin_n)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), rtol=1e-4, atol=1e-4)
    assert (score(7, 3) - score(3, 7)).abs() > 1e-3  # and does depend on it
    torch.testing.assert_close(score(0, 0), (q * k).sum())  # position 0 is no rotation


def test_rope_angles_are_position_times_theta_to_the_minus_2i_over_d():
    """RoFormer (arXiv 2104.09864, eq. 15): pair i of a D-dim head turns by m·θ^(-2i/D) at
    position m. The relative-position test above holds for any frequencies; this pins them,
    by hand: for D 8 and θ 10,000 the pairs turn by 1, 0.1, 0.01 and 0.001 rad per position.
    Measured difference 3.0e-8 (fp32), tolerance 1e-6; a wrong exponent, i/D instead of 2i/D,
    is off by 0.045 at position 1 and 1.7 at position 1,000."""
    positions = [0, 1, 7, 1000]
    cos, sin = M.rope_cos_sin(torch.tensor([positions]), 8, 10000.0)  # (1, 4, D/2)
    assert cos.shape == sin.shape == (1, 4, 4)
    for t, m in enumerate(positions):
        for i, per_position in enumerate([1.0, 0.1, 0.01, 0.001]):  # 10000 ** (-2i / 8)
            assert cos[0, t, i].item() == pytest.approx(math.cos(m * per_position), abs=1e-6)
            assert sin[0, t, i].item() == pytest.approx(math.sin(m * per_position), abs=1e-6)
    # apply_rope turns dims i and i + D/2 as one pair (the half-split of GPT-NeoX and Llama):
    # unit vector e_i goes to cos·e_i + sin·e_(i+D/2), and e_(i+D/2) to −sin·e_i + cos·e_(i+D/2).
    rotated = M.apply_rope(torch.eye(8)[None, None], cos[:, 2:3], sin[:, 2:3])[0, 0]  # m = 7
    c, s = cos[0, 2], sin[0, 2]  # (D/2,)
    want = torch.zeros(8, 8)
    for i in range(4):
        want[i, i], want[i, i + 4], want[i + 4, i], want[i + 4, i + 4] = c[i], s[i], -s[i], c[i]
    torch.testing.assert_close(rotated, want, rtol=0, atol=1e-6)


def test_nope_layers_ignore_positions_and_rope_layers_do_not():
    assert [M.uses_rope(config.StackConfig(), i) for i in range(8)] == \
        [True, True, True, False, True, True, True, False]  # layers 4 and 8, from 1
    model = small_model()
    torch.manual_seed(1)
    x = torch.randn(1, 6, 32)
    # Spread, not shifted: a uniform shift would not change RoPE's relative angles.
    near = M.rope_cos_sin(torch.arange(6)[None], 8, 10000.0)
    spread = M.rope_cos_sin(torch.arange(6)[None] * 7, 8, 10000.0)
    for block in model.blocks:
        shifted = block(x, *spread, None) - block(x, *near, None)
        if block.attn.use_rope:
            assert shifted.abs().max() > 1e-4
        else:
            assert shifted.abs().max() == 0
    assert [b.attn.use_rope for b in model.blocks] == [True, False, True, False]


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_attention_blind_to_the_scale_of_q_and_k(qk_norm):
    model = small_model(qk_norm=qk_norm)
    attn = model.blocks[0].attn
    assert isinstance(attn.q_norm, M.RMSNorm) == qk_norm
    assert isinstance(attn.k_norm, M.RMSNorm) == qk_norm
    torch.manual_seed(1)
    x = torch.randn(1, 6, 32)
    cos_sin = M.rope_cos_sin(torch.arange(6)[None], 8, 10000.0)
    before = attn(x, *cos_sin, None)
    with torch.no_grad():
        attn.q_proj.weight.mul_(10)
        attn.k_proj.weight.mul_(10)
    changed = (attn(x, *cos_sin, None) - before).abs().max()
    assert (changed < 1e-5) if qk_norm else (changed > 1e-3)


def explicit_attention_layer(attn, x, cos, sin, norm_first: bool):
    """Attention written out from its parts: project, RMSNorm each head's q and k with the
    gains (F.rms_norm), rotate each (i, i + D/2) pair by hand, causal SDPA with the kv heads
    repeated for GQA, output projection. norm_first=False rotates before the norm."""
    (B, T, _), D = x.shape, attn.head_size
    q = (x @ attn.q_proj.weight.T).view(B, T, -1, D)  # (B, T, H, D)
    k = (x @ attn.k_proj.weight.T).view(B, T, -1, D)  # (B, T, K, D)
    v = (x @ attn.v_proj.weight.T).view(B, T, -1, D)  # (B, T, K, D)

    def rotate(t):
        first, second = t.chunk(2, dim=-1)
        c, s = cos[:, :, None], sin[:, :, None]  # (B, T, 1, D/2)
        return torch.cat([first * c - second * s, second * c + first * s], dim=-1)

    def norm(t, gains):
        return F.rms_norm(t, (D,), gains, eps=attn.q_norm.eps)

    if norm_first:
        q, k = rotate(norm(q, attn.q_norm.weight)), rotate(norm(k, attn.k_norm.weight))
    else:
        q, k = norm(rotate(q), attn.q_norm.weight), norm(rotate(k), attn.k_norm.weight)
    repeat = q.shape[2] // k.shape[2]
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(repeat, dim=1),
        v.transpose(1, 2).repeat_interleave(repeat, dim=1), is_causal=True)  # (B, H, T, D)
    return y.transpose(1, 2).reshape(B, T, -1) @ attn.o_proj.weight.T  # (B, T, C)


def test_qk_norm_with_learned_gains_is_applied_before_rope():
    """With unit gains (as at init) the two orders agree to ~1e-7, since a rotation keeps the
    RMS; learned gains that differ between dims i and i + D/2 do not commute with it. So the
    gains here are random, and the layer must equal the norm-then-rotate reference. Measured
    difference 0.0 (relative to the output's largest entry), tolerance 1e-6; rotate-then-norm
    is off by 0.14 (and by 1.6e-7 with unit gains, which is why they are not used here)."""
    attn = small_model().blocks[0].attn
    assert attn.use_rope and isinstance(attn.q_norm, M.RMSNorm)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.rand(8, generator=gen) * 1.5 + 0.25)  # (D,) in [0.25, 1.75]
        attn.k_norm.weight.copy_(torch.rand(8, generator=gen) * 1.5 + 0.25)
    x = torch.randn(2, 7, 32, generator=gen)
    cos, sin = M.rope_cos_sin(torch.arange(7).expand(2, 7) * 3, 8, 10000.0)  # sizeable angles
    with torch.no_grad():
        out = attn(x, cos, sin, None)
        scale = out.abs().max()
        right = (out - explicit_attention_layer(attn, x, cos, sin, norm_first=True)).abs().max()
        swapped = (out - explicit_attention_layer(attn, x, cos, sin, norm_first=False)).abs().max()
    assert right / scale < 1e-6, (right / scale).item()
    assert swapped / scale > 10 * 1e-6, (swapped / scale).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_functional(dtype):
    """RMSNorm against torch's F.rms_norm in fp32, for the residual stream's fp32 and
    QK-norm's bf16 inputs: the output in x's dtype, and the gradients."""
    norm = M.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16).to(dtype).requires_grad_()
    got = norm(x)
    want = F.rms_norm(x.float(), (16,), norm.weight, eps=1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want.to(dtype))
    grad = torch.randn(3, 5, 16).to(dtype)
    got_x, got_w = torch.autograd.grad(got, (x, norm.weight), grad)
    want_x, want_w = torch.autograd.grad(want, (x, norm.weight), grad.float())
    tol = 1e-6 if dtype == torch.float32 else 2**-8  # bf16's x.grad: rounded once
    torch.testing.assert_close(got_x.float(), want_x.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_document_block_mask_matches_dense_mask_on_cpu():
    # Eager flex_attention runs forward (not backward) on CPU: enough to check the BlockMask
    # rule, at a length (200) that is not a multiple of flex's 128-token blocks.
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    B, H, K, T, D = 2, 4, 2, 200, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, K, T, D), torch.randn(B, K, T, D)
    seq_ids = torch.zeros(B, T, dtype=torch.long)
    seq_ids[0, 70:] = 1
    seq_ids[1, 30:] = 1
    seq_ids[1, 150:] = 2
    flex = flex_attention(q, k, v, block_mask=M.document_block_mask(seq_ids), enable_gqa=True)
    dense = M.attention(q, k, v, M.document_dense_mask(seq_ids))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_seq_ids", [False, True])
def test_block_compiles_without_graph_breaks(with_seq_ids):
    # fullgraph=True fails on any graph break; aot_eager traces forward and backward
    # without needing a C++ compiler, so this runs in seconds. The gradients, of the input
    # and of every weight, are eager's too.
    block = small_model().blocks[0]
    x = torch.randn(2, 8, 32, requires_grad=True)
    cos, sin = M.rope_cos_sin(torch.arange(8).expand(2, 8), 8, 10000.0)
    seq_ids = torch.tensor([[0] * 3 + [1] * 5] * 2) if with_seq_ids else None
    mask = M.attention_mask(seq_ids, x.device)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got, want = compiled(x, cos, sin, mask), block(x, cos, sin, mask)
    torch.testing.assert_close(got, want)
    inputs, grad = (x, *block.parameters()), torch.randn_like(want)
    for ours, theirs in zip(torch.autograd.grad(got, inputs, grad),
                            torch.autograd.grad(want, inputs, grad), strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_compiled_block_traces_flex_attention_itself(monkeypatch):
    """Inside a compiled block flex_attention is compiled with the block: the cached
    compiled copy (model.compiled_kernel), which eager calls need, is not reached while
    tracing (dynamo warns that a functools.cache'd function it traces may be silently
    wrong). A CPU BlockMask takes the CUDA path's lines, forward only."""
    reached = []
    monkeypatch.setattr(M, "compiled_kernel", lambda kernel, **options: reached.append(kernel) or
                        (lambda *args, **kwargs: kernel(*args, **kwargs)))
    block = small_model().blocks[0]
    x = torch.randn(2, 128, 32)
    cos, sin = M.rope_cos_sin(torch.arange(128).expand(2, 128), 8, 10000.0)
    seq_ids = torch.tensor([[0] * 50 + [1] * 78] * 2)
    mask = M.document_block_mask(seq_ids)  # eager on CPU: built without `compiled`
    with torch.no_grad():
        traced = torch.compile(block, backend="eager", fullgraph=True)(x, cos, sin, mask)
        assert reached == []
        torch.testing.assert_close(traced, block(x, cos, sin, mask))  # eager: the cached copy
    assert reached and reached[0] is M.flex_attention


def test_generation_with_compiled_blocks_compiles_nothing(monkeypatch):
    """The end-of-run sample runs the uncompiled blocks: each step's new cache length, batch
    of 1 and grad mode off would make compiled ones compile again and again (up to dynamo's
    limit of 8), seconds each on a CPU and an inductor compile each on a GPU. A counting
    backend sees every compile."""
    model, graphs = small_model(init_std=0.3), []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward
    eager = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, temperature=0)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=counting)
    ids = torch.randint(0, 97, (2, 8))
    model(ids, ids)  # a training forward compiles the blocks
    compiled = len(graphs)
    generated = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, temperature=0)
    assert compiled > 0 and len(graphs) == compiled
    assert torch.equal(generated, eager)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_attention_matches_dense_mask_on_cuda():
    torch.manual_seed(0)
    B, H, K, T, D = 2, 8, 2, 256, 64
    q, k, v = (torch.randn(B, n, T, D, device="cuda", requires_grad=True)
               for n in (H, K, K))
    seq_ids = torch.zeros(B, T, dtype=torch.long, device="cuda")
    seq_ids[0, 100:] = 1
    seq_ids[1, 37:] = 1
    seq_ids[1, 200:] = 2
    assert M.attention_backend(q.device, True) == "flex"
    flex = M.attention(q, k, v, M.attention_mask(seq_ids, q.device))
    dense = M.attention(q, k, v, M.document_dense_mask(seq_ids))
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)
    grads_flex = torch.autograd.grad(flex.square().sum(), (q, k, v))
    grads_dense = torch.autograd.grad(dense.square().sum(), (q, k, v))
    for got, want in zip(grads_flex, grads_dense, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_bf16_autocast_training_step_is_close_to_fp32():
    model = small_model()
    ids = torch.randint(0, 97, (2, 16))
    seq_ids = torch.tensor([[0] * 6 + [1] * 10] * 2)
    loss32 = model(ids, targets=ids, seq_ids=seq_ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16 = model(ids, targets=ids, seq_ids=seq_ids).loss
    loss16.backward()
    assert loss16.dtype == torch.float32
    assert abs(loss16.item() - loss32.item()) < 2e-2 * loss32.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------
# Activation recomputation, initialisation
# ---------------------------------------------------------------------------------------


RECOMPUTE_MODES = ("none", "selective", "full", "every-2")


def recomputed(model: M.Transformer, mode: str) -> M.Transformer:
    """The model with activation_recompute=mode, as the trainer sets it."""
    cfg = overrides.apply_overrides(config.tiny(), {"activation_recompute": mode})
    for layer, block in enumerate(model.blocks):
        block.recompute = cfg.block_recompute(layer)
    return model


def step_under(model, ids, seq_ids, bf16: bool):
    """Loss, gradients, the bytes the forward left for backward (conftest.KeptForBackward)
    and the FLOPs of forward + backward (FlopCounterMode: recomputation included)."""
    model.zero_grad()
    keeper = KeptForBackward(exclude=list(model.parameters()) + [ids, seq_ids])
    with FlopCounterMode(display=False) as flops:
        with keeper, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids, targets=ids, seq_ids=seq_ids).loss
        kept = keeper.bytes()
        loss.backward()
    return loss, [p.grad.clone() for p in model.parameters()], kept, flops.get_total_flops()


@pytest.mark.parametrize("bf16", [False, True])
def test_recomputation_keeps_the_gradients_and_trades_memory_for_compute(bf16):
    """Every mode's loss and gradients are those of none, bitwise: recomputation runs the
    same CPU kernels on the same inputs, which give the same bits. Selective recomputation
    keeps strictly less than none and more than full for backward, and recomputes strictly
    more than none and less than full (FlopCounterMode counts the recomputed matmuls)."""
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    seq_ids = (torch.arange(24) >= 10).long().expand(2, 24)  # two documents a row
    model = small_model()
    runs = {mode: step_under(recomputed(model, mode), ids, seq_ids, bf16)
            for mode in RECOMPUTE_MODES}
    loss, grads, _, _ = runs["none"]
    for mode in RECOMPUTE_MODES[1:]:
        assert torch.equal(runs[mode][0], loss), mode
        assert all(torch.equal(a, b) for a, b in zip(runs[mode][1], grads, strict=True)), mode
    kept = {mode: run[2] for mode, run in runs.items()}
    flops = {mode: run[3] for mode, run in runs.items()}
    assert kept["full"] < kept["every-2"] < kept["none"]
    assert kept["full"] < kept["selective"] < kept["none"]
    assert flops["none"] < flops["selective"] < flops["full"]


def test_selective_recomputation_keeps_attention_and_every_other_matmul_of_each_block():
    """The policy, per block: of a block's seven matmuls it keeps the 1st, 3rd, 5th and 7th
    (q, v, gate and down) and attention's output, and no other op's, whatever the blocks
    before it did (a count shared by the blocks would shift it). (torch 2.13 replays these
    forward decisions when it recomputes; 2.11 asks the policy again, which counts its
    recomputation apart.)"""
    policies = []  # per block call: [(op, kept)] in the forward

    def recording(policy):
        decisions = []
        policies.append(decisions)

        def wrapped(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if not ctx.is_recompute:
                decisions.append((op, decision == M.CheckpointPolicy.MUST_SAVE))
            return decision
        return real(wrapped)
    real = M.create_selective_checkpoint_contexts
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    model = recomputed(small_model(n_layers=3), "selective")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(M, "create_selective_checkpoint_contexts", recording)
        model(ids, targets=ids, seq_ids=torch.zeros_like(ids)).loss.backward()
    mm = torch.ops.aten.mm.default
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert len(policies) == 3
    for decisions in policies:
        assert [kept for op, kept in decisions if op == mm] == [True, False] * 3 + [True]
        assert [op for op, kept in decisions if kept and op != mm] == [sdpa]


def test_init_weights_follows_its_docstring():
    cfg = small_cfg(d_model=128, intermediate=512, n_layers=8, vocab_size=512)
    torch.manual_seed(0)
    model = M.Transformer(cfg)
    residual_std = 0.02 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.all(p == 1), name
            continue
        want = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        assert abs(p.std().item() / want - 1) < 0.05, name
        assert abs(p.mean().item()) < 0.1 * want, name


# ---------------------------------------------------------------------------------------
# Parameter and FLOP accounting
# ---------------------------------------------------------------------------------------


def test_default_parameter_count_is_101_3m():
    cfg = config.StackConfig()
    with torch.device("meta"):  # shapes only, no memory
        model = M.Transformer(cfg)
    assert M.count_params(model) == M.count_params(cfg)
    assert abs(M.count_params(cfg) - 101.3e6) <= 0.1e6
    assert abs(M.count_params(M.Transformer(config.tiny_model())) - 4e6) < 0.2e6


def test_default_flops_per_token_reproduce_published_figures():
    cfg = config.StackConfig()
    assert M.flops_per_token(cfg, 2048, "causal") == pytest.approx(7.97e8, rel=0.01)
    assert M.flops_per_token(cfg, 2048, "palm") == pytest.approx(9.85e8, rel=0.01)
    with pytest.raises(ValueError, match="convention"):
        M.flops_per_token(cfg, 2048, "kaplan")


def test_flop_counts_match_flop_counter_mode():
    """FlopCounterMode counts matmuls and attention kernels (not elementwise ops). The math
    SDPA backend is used because the CPU flash kernel has no FLOP formula registered;
    it computes all T² scores, masked or not, as the PaLM convention assumes."""
    cfg = small_cfg(vocab_size=256, d_model=64, intermediate=160, ce_chunk_size=64)
    model = M.Transformer(cfg)
    B, T = 2, 32
    ids = torch.randint(0, 256, (B, T))

    def counted(step):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            with FlopCounterMode(display=False) as counter:
                step()
        return counter.get_total_flops()

    def full_logits_step():
        logits = model.logits(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

    forward = counted(lambda: model.logits(ids))
    train = counted(full_logits_step)
    tokens = B * T
    # Every matmul's backward is two matmuls of the same size: exactly 3x forward.
    assert train == 3 * forward
    # PaLM convention = what the kernels compute; exact, as both count only matmuls.
    assert train == M.flops_per_token(cfg, T, "palm") * tokens
    # Causal convention: counts norm gains (no matmul; 0.5% of N here) and half the
    # attention. Adding back the masked half the dense kernel still computes, it agrees
    # with the counter to the norm gains' share: tolerance 1%.
    masked_half = 6 * cfg.n_layers * T * cfg.n_heads * cfg.head_size
    assert (M.flops_per_token(cfg, T, "causal") + masked_half) * tokens == \
        pytest.approx(train, rel=0.01)
    # The chunked head recomputes its logits in backward: one extra head forward, 2·V·C
    # per token, on top of the convention.
    chunked = counted(lambda: model(ids, targets=ids).loss.backward())
    assert chunked == train + 2 * cfg.vocab_size * cfg.d_model * tokens


# ---------------------------------------------------------------------------------------
# Generation and sample.py
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_kv_cache_generation_equals_greedy_decoding_without_cache(mode):
    """Under every activation_recompute mode: the end-of-run sample generates with the
    blocks the trainer set to recompute. The oracle is greedy decoding by whole forwards,
    without a cache, of the model before it was set to recompute anything."""
    model = small_model(init_std=0.3)  # at std 0.02 a random model repeats one token
    prompt = torch.randint(0, 97, (2, 5))
    tokens = prompt
    with torch.no_grad():
        for _ in range(20):
            logits = model.logits(tokens, last_only=True)  # the whole sequence again
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    generated = recomputed(model, mode).generate(prompt, max_new_tokens=20, temperature=0)
    assert torch.equal(generated, tokens)
    assert len(set(tokens[0, 5:].tolist())) > 1  # not a degenerate constant sequence


def test_sampling_respects_top_k_and_temperature():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    top3 = logits.topk(3).indices
    for _ in range(20):
        token = M.sample_next_token(logits, temperature=1.5, top_k=3)
        assert (token == top3).any(dim=1).all()
    assert torch.equal(M.sample_next_token(logits, 1.0, top_k=1), logits.argmax(-1, True))
    assert torch.equal(M.sample_next_token(logits, 0, None), logits.argmax(-1, True))
    with pytest.raises(ValueError, match="max_seq_len"):
        small_model().generate(torch.zeros(1, 60, dtype=torch.long), max_new_tokens=10)


SAMPLING_LOGITS = [3.0, 2.0, 1.0, 0.0, -1.0, -2.0]


def softmax_by_hand(logits: list[float]) -> list[float]:
    weights = [math.exp(x) for x in logits]
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_follows_softmax_of_logits_over_temperature(temperature):
    """A million draws (one per row) against softmax(logits / T), computed by hand. Largest
    frequency error measured 1.4e-4 (T 0.5) and 4.4e-4 (T 2); ~1.2e-3 at worst over 20
    seeds, where one draw's standard error is 4.9e-4. Tolerance 0.01. A temperature that is
    ignored, or that multiplies the logits, moves some probability by 0.22 or 0.45: >= 10x."""
    tolerance = 0.01
    want = softmax_by_hand([x / temperature for x in SAMPLING_LOGITS])
    n = 1_000_000
    torch.manual_seed(0)
    draws = M.sample_next_token(torch.tensor(SAMPLING_LOGITS).expand(n, 6), temperature, None)
    assert draws.shape == (n, 1)
    frequencies = (torch.bincount(draws.flatten(), minlength=6) / n).tolist()
    assert max(abs(f - w) for f, w in zip(frequencies, want, strict=True)) < tolerance
    for wrong in (softmax_by_hand(SAMPLING_LOGITS),  # temperature ignored
                  softmax_by_hand([x * temperature for x in SAMPLING_LOGITS])):  # multiplied
        assert max(abs(a - w) for a, w in zip(wrong, want, strict=True)) > 10 * tolerance


def write_tiny_export(export_dir, **model_overrides):
    """A random tiny model and a small byte-level BPE tokenizer, as export.py writes them for sample.py (less provenance.json, which sampling
    does not need)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 20
    tokenizer.train_from_iterator(text, trainer)
    cfg = small_cfg(vocab_size=tokenizer.get_vocab_size(), **model_overrides)
    torch.manual_seed(0)
    os.makedirs(export_dir, exist_ok=True)
    torch.save(M.Transformer(cfg).state_dict(), os.path.join(export_dir, "model.pt"))
    with open(os.path.join(export_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f)
    tokenizer.save(os.path.join(export_dir, "tokenizer.json"))
    return cfg


def greedy_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The oracle for model.complete at temperature 0: model.generate on the prompt's ids,
    after the end-of-text token that opens every document in training (data.py), decoded
    whole. It must not stop early, so that nothing is cut."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids = [eot] + tokenizer.encode(prompt).ids
    tokens = model.generate(torch.tensor([ids]), max_new_tokens, temperature=0)[0].tolist()
    new = tokens[len(ids):]
    assert len(new) == max_new_tokens and eot not in new and len(set(new)) > 3, new
    return tokenizer.decode(tokens[1:])


def test_greedy_completion_is_the_whole_generated_text(tmp_path):
    import sample

    write_tiny_export(str(tmp_path), init_std=0.3)  # at 0.02 it repeats one token
    model, tokenizer, eos_id = sample.load_export(str(tmp_path))
    want = greedy_text(model, tokenizer, "def add(", 24)
    assert M.complete(model, tokenizer, "def add(", 24, temperature=0, top_k=None,
                      eos_id=eos_id) == want
    assert want.startswith("def add(") and len(want) > len("def add(") + 10


def test_completion_stops_at_the_first_end_of_text():
    """A scripted model whose generate appends a, b, <eot>, c: the text is the prompt and
    a, b, decoded."""
    import types

    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "x": 1, "a": 2, "b": 3, "c": 4},
                                           unk_token="x"))
    continuation = torch.tensor([[2, 3, 0, 4]])
    scripted = types.SimpleNamespace(
        embed=types.SimpleNamespace(weight=torch.zeros(1)),
        generate=lambda ids, n, temperature, top_k: torch.cat([ids, continuation], dim=1))
    assert M.complete(scripted, tokenizer, "x", 4, temperature=0, top_k=None, eos_id=0) == \
        tokenizer.decode([1, 2, 3])


def test_sample_cli_prints_whole_greedy_completions(tmp_path):
    """The CLI end to end at temperature 0: each printed completion is model.generate's
    whole text, decoded, not just something that starts with the prompt."""
    import sample

    export = tmp_path / "export"
    write_tiny_export(str(export), init_std=0.3)
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "sample.py"), "--export", str(export),
         "--prompt", "def ", "--max_new_tokens", "16", "--temperature", "0",
         "--top_k", "0", "--num_samples", "2", "--seed", "1337"],
        capture_output=True, text=True, encoding="utf-8", timeout=60, cwd=str(tmp_path),
        env=os.environ | {"PYTHONIOENCODING": "utf-8"})
    assert result.returncode == 0, result.stderr
    model, tokenizer, _ = sample.load_export(str(export))
    want = greedy_text(model, tokenizer, "def ", 16)
    assert result.stdout == f"{want}\n---------------\n" * 2


def test_load_export_round_trips_the_weights(tmp_path):
    import sample

    cfg = write_tiny_export(str(tmp_path))
    model, tokenizer, eos_id = sample.load_export(str(tmp_path))
    torch.manual_seed(0)
    fresh = M.Transformer(cfg)
    for (name, p), q in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert eos_id == tokenizer.token_to_id("<|endoftext|>") is not None
    assert not model.training


# ---------------------------------------------------------------------------------------
# The loss head on bf16 operands (TrainConfig.loss_head_dtype="bf16")
# ---------------------------------------------------------------------------------------

def test_loss_head_dtype_knob_reaches_the_head():
    """TrainConfig.loss_head_dtype -> train.build_model -> model.loss_head_dtype -> the
    head: the bf16 model's loss moves by operand rounding only; other values are refused, and
    so is bf16 without the chunked head (the plain head has no such knob)."""
    import train

    cfg = overrides.apply_overrides(config.tiny(), {"loss_head_dtype": "bf16",
                                                 "model.ce_chunk_size": 1024})
    assert train.build_model(cfg, compile_blocks=False).loss_head_dtype == "bf16"
    with pytest.raises(ValueError, match="loss_head_dtype=bf16 sets the chunked loss head's "
                                         "matmul inputs, and model.ce_chunk_size=0"):
        overrides.apply_overrides(config.tiny(), {"loss_head_dtype": "bf16"})
    model = small_model()
    ids = torch.randint(0, 97, (2, 12))
    loss32 = model(ids, targets=ids).loss
    model.loss_head_dtype = "bf16"
    loss16 = model(ids, targets=ids).loss
    assert loss16 != loss32 and abs(loss16 - loss32) < 1e-2 * loss32
    with pytest.raises(ValueError, match="loss_head_dtype"):
        config.TrainConfig(loss_head_dtype="fp16")
