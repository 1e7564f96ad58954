"""RMSNorm with its backward written out: model.py's `RMSNorm` computes through it.

Eager autograd runs the backward of each of the forward's ops on its own: on a CPU, six
passes over the activations and as many temporaries, for a norm that runs twice in every
block (four times with QK-norm). With n = x·r the normalised x and
r = rsqrt(mean(x²) + eps) per row, the gradient autograd would give is, in fewer passes,

    dweight = Σ over every row of g·n,    dx = r·(g·weight − n·mean(g·weight·n))

(from dn_i/dx_j = r·δ_ij − r·n_i·n_j/D). tests/test_model.py checks it against autograd
of the plain expression, and in fp64 with gradcheck.

Imports from stacklm: nothing.
"""

import torch


class RMSNormFunction(torch.autograd.Function):
    """x · rsqrt(mean(x²) + eps) · weight over the last dim, computed in fp32 (in bf16 the
    mean of squares loses the small components; fp64 stays fp64) and returned in x's
    dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        r = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)  # (..., 1)
        n = x32 * r  # (..., D)
        ctx.save_for_backward(n, r, weight)
        out = n * weight.to(n.dtype)
        # torch 2.11: where the cast back is a no-op (fp32 x) it returns `out` itself, and in
        # a compiled block dynamo then lists `out` twice among the forward's outputs, which
        # sends the incoming gradient to the wrong one: backward sees zeros, and x and the
        # gain get no gradient (pytorch/pytorch#180642, fixed in 2.12 by #180921). So a cast
        # only where the dtype changes: never return an intermediate itself from here.
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        n, r, weight = ctx.saved_tensors
        g = grad.to(n.dtype)
        gw = g * weight.to(n.dtype)
        dx = (gw - n * (gw * n).mean(-1, keepdim=True)) * r
        dweight = (g * n).flatten(0, -2).sum(0)  # (D,)
        return dx.to(grad.dtype), dweight.to(weight.dtype), None


def rms_norm(x, weight, eps: float):
    return RMSNormFunction.apply(x, weight, eps)
