"""The loss: model.reference_loss against torch's own functions (F.cross_entropy +
z·torch.logsumexp², autograd), and loss.py's chunked head against reference_loss on the full
(N, V) logits, fp64 gradcheck, and the rounding bounds of bf16 operands."""

import pytest
import torch
import torch.nn.functional as F

import model as M
from loss import fused_ce_z_loss


def full_logits_loss(hidden, weight, targets, z_loss, reduction="mean") -> M.Loss:
    """The oracle of the chunked head: model.reference_loss on the full (N, V) logits."""
    return M.reference_loss(hidden @ weight.T, targets, z_loss, reduction=reduction)


def loss_inputs(dtype, n=23, d=8, v=13, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, d, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[[0, 5, 6, n - 1]] = -100  # ignored, including the first and last rows
    return hidden, weight, targets


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_and_grads_equal_full_logits_fp32(reduction):
    hidden, weight, targets = loss_inputs(torch.float32)
    z_loss = 0.05  # large enough that a wrong z gradient shows
    loss, ce, z = fused_ce_z_loss(hidden, weight, targets, z_loss, chunk_size=5,
                                    reduction=reduction)  # 5 does not divide 23
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref = full_logits_loss(hidden, weight, targets, z_loss, reduction)
    ref_grads = torch.autograd.grad(ref.loss, (hidden, weight))
    torch.testing.assert_close(ce, ref.ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z, ref.z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads[0][[0, 5, 6, 22]].abs().max() == 0  # ignored rows get no gradient
    assert not ce.requires_grad and not z.requires_grad


def test_chunked_loss_gradcheck_fp64():
    hidden, weight, targets = loss_inputs(torch.float64, n=11, d=4, v=7)

    def loss_fn(h, w):
        return fused_ce_z_loss(h, w, targets, 0.1, chunk_size=4)[0]

    assert torch.autograd.gradcheck(loss_fn, (hidden, weight))
    ref = full_logits_loss(hidden, weight, targets, 0.1).loss
    torch.testing.assert_close(loss_fn(hidden, weight), ref, rtol=1e-12, atol=1e-12)


def test_chunked_loss_keeps_fp32_logits_under_bf16_autocast():
    hidden, weight, targets = loss_inputs(torch.float32, n=64, d=32, v=50)
    hidden16 = hidden.detach().bfloat16().requires_grad_()
    weight16 = weight.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = fused_ce_z_loss(hidden16, weight16, targets, 1e-4, chunk_size=16)
    loss.backward()
    # Oracle: the same bf16 values, upcast, through fp32 full logits. A bf16 head matmul
    # would be off by ~1e-2.
    ref = full_logits_loss(hidden16.detach().float(), weight16.detach().float(), targets,
                           1e-4).loss
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-5, atol=1e-5)
    assert hidden16.grad.dtype == torch.bfloat16 and weight16.grad.dtype == torch.bfloat16


# bf16 keeps 8 significant bits: rounding to nearest moves x by at most 2^-8·|x|.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def head_inputs(n=48, d=64, v=300, seed=0):
    """Unit-scale hidden states and a head whose logits have std ~3 (logsumexp ~10, as
    early in training), with three ignored rows."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen)
    weight = 0.4 * torch.randn(v, d, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[[0, 7, n - 1]] = -100
    return hidden, weight, targets


def head_loss_and_grads(hidden, weight, targets, head_dtype, z_loss=0.01):
    """(loss, grad_hidden, grad_weight) of the chunked head; z_loss large enough that a
    wrong z-loss gradient shows, chunk_size 20 not dividing the 48 rows."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _, _ = fused_ce_z_loss(hidden, weight, targets, z_loss, chunk_size=20,
                                   head_dtype=head_dtype)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def test_bf16_head_is_the_fp32_head_on_bf16_rounded_operands():
    """Given operands already rounded to bf16, the bf16 head must compute what the fp32 head
    computes. Forward: its logits, softmax and logsumexp are fp32, so the losses agree to
    fp32 summation noise (rtol 1e-5); a logsumexp rounded to bf16, or logits written in
    bf16, were off by 2.6e-4 and 3.0e-4 relative. Backward: the one extra rounding is
    dlogits' to bf16 before the two gradient matmuls; each dlogits element moves by at most
    2^-8 of itself, so each gradient element by at most 2^-8·(|dlogits| @ |the other
    operand|), the bound checked (+1% for fp32 summation order; measured up to 0.91 of it).
    The oracle dlogits come from autograd through full logits and F.cross_entropy."""
    hidden, weight, targets = head_inputs()
    hidden, weight = hidden.bfloat16().float(), weight.bfloat16().float()
    loss16, grad_hidden16, grad_weight16 = head_loss_and_grads(hidden, weight, targets, "bf16")
    loss32, grad_hidden32, grad_weight32 = head_loss_and_grads(hidden, weight, targets, "fp32")
    torch.testing.assert_close(loss16, loss32, rtol=1e-5, atol=0)

    logits = (hidden @ weight.T).requires_grad_()  # (N, V)
    valid = targets != -100
    lse = torch.logsumexp(logits, dim=-1)[valid]
    reference = (F.cross_entropy(logits, targets, reduction="sum")
                 + 0.01 * lse.square().sum()) / valid.sum()
    dlogits, = torch.autograd.grad(reference, logits)
    bound_hidden = 1.01 * BF16_UNIT_ROUNDOFF * (dlogits.abs() @ weight.abs())  # (N, C)
    bound_weight = 1.01 * BF16_UNIT_ROUNDOFF * (dlogits.abs().T @ hidden.abs())  # (V, C)
    assert ((grad_hidden16 - grad_hidden32).abs() <= bound_hidden).all()
    assert ((grad_weight16 - grad_weight32).abs() <= bound_weight).all()
    assert not torch.equal(grad_weight16, grad_weight32)  # the bf16 path did run


def test_bf16_head_stays_within_operand_rounding_of_the_fp32_head():
    """On fp32 operands the bf16 head differs from the fp32 head only by rounding them to
    bf16 (2^-8 relative each). To first order every logit then moves by at most
    δ = 2·2^-8·(|h| @ |w|ᵀ), so each row's lse − l_y + z·lse² by at most
    (1 + 2z·|lse|)·max δ + δ_y: that bound, averaged over the rows, is the loss tolerance.
    Gradients: a relative (Frobenius) error of at most 4·2^-8 ≈ 1.6%, room for the rounding
    of both operands and of dlogits (measured ~0.3% here); a gradient that drops the
    z-loss term or a chunk is off by far more."""
    hidden, weight, targets = head_inputs()
    loss16, *grads16 = head_loss_and_grads(hidden, weight, targets, "bf16")
    loss32, *grads32 = head_loss_and_grads(hidden, weight, targets, "fp32")
    valid = targets != -100
    shift = 2 * BF16_UNIT_ROUNDOFF * (hidden.abs() @ weight.abs().T)  # (N, V)
    lse = torch.logsumexp(hidden @ weight.T, dim=-1)  # (N,)
    row_bound = ((1 + 2 * 0.01 * lse.abs()) * shift.amax(dim=-1)
                 + shift.gather(1, targets.clamp(min=0)[:, None]).squeeze(1))
    assert (loss16 - loss32).abs() <= row_bound[valid].mean()
    for got, want in zip(grads16, grads32, strict=True):
        assert (got - want).norm() <= 4 * BF16_UNIT_ROUNDOFF * want.norm()


# --- reference_loss, the plain head's, against torch's functions ------------------------

def torch_loss(logits, targets, z_loss, reduction):
    """The oracle: F.cross_entropy, and the z-loss from torch.logsumexp, on fp32 logits."""
    logits = logits.float()
    kept = targets != -100
    ce = F.cross_entropy(logits, targets, reduction="sum")
    z = z_loss * torch.logsumexp(logits, dim=-1)[kept].square().sum()
    n = kept.sum() if reduction == "mean" else 1
    return (ce + z) / n, ce / n, z / n


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reference_loss_and_grads_equal_torchs_cross_entropy(reduction):
    """Values and gradient, ignored rows included."""
    hidden, weight, targets = loss_inputs(torch.float32)
    logits = (hidden @ weight.T).detach().requires_grad_()  # (23, 13)
    loss, ce, z = M.reference_loss(logits, targets, 0.05, reduction=reduction)
    [grad] = torch.autograd.grad(loss, logits)
    want = torch_loss(logits, targets, 0.05, reduction)
    [want_grad] = torch.autograd.grad(want[0], logits)
    for got, expected in ((loss, want[0]), (ce, want[1]), (z, want[2]), (grad, want_grad)):
        torch.testing.assert_close(got, expected.detach(), rtol=1e-6, atol=1e-6)
    assert grad[[0, 5, 6, 22]].abs().max() == 0  # ignored rows get no gradient
    assert not ce.requires_grad and not z.requires_grad


def test_reference_loss_of_bf16_logits_is_taken_in_fp32():
    """The plain head's bf16 logits (under autocast): the loss is torch's of their exact fp32
    values, and the gradient, in the logits' dtype, is torch's rounded to bf16 (at most half
    a bf16 ulp off, ~0.4% relative)."""
    hidden, weight, targets = loss_inputs(torch.float32, n=64, d=32, v=50)
    logits16 = (hidden @ weight.T).detach().bfloat16().requires_grad_()
    loss = M.reference_loss(logits16, targets, 1e-2).loss
    [grad] = torch.autograd.grad(loss, logits16)
    exact = logits16.detach().float().requires_grad_()
    want = torch_loss(exact, targets, 1e-2, "mean")[0]
    [want_grad] = torch.autograd.grad(want, exact)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.float(), want_grad, rtol=2**-8, atol=1e-7)
