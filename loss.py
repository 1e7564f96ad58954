"""The loss head at scale: model.py's `reference_loss` (cross-entropy + z-loss) of the logits
hidden @ weight.T, computed `chunk_size` rows at a time so that the (N, V) logits never exist
whole (`fused_ce_z_loss`).

The loss head, not attention, dominates Stack-100M's memory: one micro-batch feeds it
N = 32 × 2,048 rows of V = 32,768 logits, 8 GiB in fp32, and backward would make as much
again for their gradient. `Transformer.forward` takes this head whenever `ce_chunk_size` is
set. Forward keeps only each row's logsumexp (N floats), and backward recomputes each
chunk's logits: one extra head matmul, paid in compute instead of memory (the idea of Cut
Cross-Entropy, arXiv 2411.09009, and Liger's fused linear CE, arXiv 2410.10989). One
logsumexp per row serves both terms, and backward writes the gradient in one pass over each
chunk. Its logits are fp32 (model.py's loss section says which head keeps which precision).

tests/test_loss.py checks it against `reference_loss`, F.cross_entropy, gradcheck and the
rounding bounds of bf16 operands.

Imports from stacklm: nothing.
"""

import torch


class ChunkedCrossEntropyZLoss(torch.autograd.Function):
    """Per row with logits l, softmax p, lse = logsumexp(l), target y and weight g
    (g = upstream grad × 1/N_valid for "mean", 0 on ignored rows):
        loss = g · (lse − l_y + z·lse²)
        dloss/dl = g · (p · (1 + 2z·lse) − onehot(y))

    head_dtype="bf16" rounds the operands of the chunk matmuls (hidden and weight; in
    backward also dlogits) to bf16, the tensor cores' fast input, but every matmul still
    accumulates and writes fp32 (`head_matmul`), and logits, softmax, logsumexp and the loss
    stay fp32: the only new error is the operands' rounding, at most 2^-8 relative each.
    "fp32" keeps fp32 operands (which CUDA runs as TF32 under the trainer's matmul setting).
    Logits are fp64 for fp64 inputs (gradcheck).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, z_loss, chunk_size, ignore_index, reduction,
                head_dtype):
        # Autocast would run the head matmul in bf16 and write bf16 logits.
        with torch.autocast(hidden.device.type, enabled=False):
            dtype = torch.promote_types(hidden.dtype, torch.float32)  # logits, lse, grads
            operand = torch.bfloat16 if head_dtype == "bf16" else dtype  # matmul inputs
            w = weight.to(operand)  # (V, C)
            valid = targets != ignore_index  # (N,)
            safe_targets = targets.masked_fill(~valid, 0)  # any real index; masked below
            lse = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
            target_logit = torch.empty_like(lse)
            buffer = chunk_buffer(len(hidden), len(w), chunk_size, dtype, w.device)
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                h = hidden[rows].to(operand)  # (chunk, C)
                logits = head_matmul(h, w.T, dtype, out=buffer[: h.shape[0]])  # (chunk, V)
                target_logit[rows] = logits.gather(1, safe_targets[rows, None]).squeeze(1)
                # logsumexp in place: torch.logsumexp would allocate a second (chunk, V).
                row_max = logits.amax(dim=-1, keepdim=True)  # (chunk, 1)
                lse[rows] = (row_max + logits.sub_(row_max).exp_().sum(-1, keepdim=True).log()
                             ).squeeze(1)
            divisor = valid.sum().clamp(min=1) if reduction == "mean" else lse.new_ones(())
            ce = torch.where(valid, lse - target_logit, 0.0).sum() / divisor
            z = torch.where(valid, z_loss * lse.square(), 0.0).sum() / divisor
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.z_loss, ctx.chunk_size, ctx.ignore_index, ctx.divisor, ctx.head_dtype = (
            z_loss, chunk_size, ignore_index, divisor, head_dtype)
        ctx.mark_non_differentiable(ce, z)
        return ce + z, ce, z

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_z):
        hidden, weight, targets, lse = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            dtype = lse.dtype
            operand = torch.bfloat16 if ctx.head_dtype == "bf16" else dtype
            w = weight.to(operand)  # (V, C)
            valid = targets != ctx.ignore_index
            safe_targets = targets.masked_fill(~valid, 0)
            g = torch.where(valid, grad_loss / ctx.divisor, 0.0)  # (N,) each row's weight
            softmax_scale = g * (1 + 2 * ctx.z_loss * lse)  # (N,)
            grad_hidden = torch.empty_like(hidden)
            # (V, C), accumulated in fp32 (or fp64)
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
            buffer = chunk_buffer(len(hidden), len(w), ctx.chunk_size, dtype, w.device)
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                h = hidden[rows].to(operand)  # (chunk, C)
                # In place, so one (chunk, V) buffer goes logits -> softmax -> dlogits.
                dlogits = head_matmul(h, w.T, dtype, out=buffer[: h.shape[0]])  # logits
                dlogits.sub_(lse[rows, None]).exp_()  # softmax
                dlogits.mul_(softmax_scale[rows, None])
                dlogits.scatter_add_(1, safe_targets[rows, None], -g[rows, None])
                dlogits = dlogits.to(operand)  # (chunk, V); bf16 head: rounded here
                grad_hidden[rows] = head_matmul(dlogits, w, dtype)  # (chunk, C)
                if operand == dtype:
                    # In place; the out= form, unlike addmm_, is seen by FlopCounterMode.
                    torch.addmm(grad_weight, dlogits.T, h, out=grad_weight)  # (V, C)
                else:  # CUDA's bf16 addmm cannot add into fp32: the product, then the sum
                    grad_weight += head_matmul(dlogits.T, h, dtype)  # (V, C)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def chunk_buffer(n: int, vocab: int, chunk_size: int, dtype: torch.dtype, device):
    """One (chunk, V) buffer reused by every chunk of n rows: on CPU a fresh one per chunk
    made the head slower (docs/figures.md; the allocator hands back new pages that must be
    faulted in)."""
    return torch.empty(min(chunk_size, n), vocab, dtype=dtype, device=device)


def head_matmul(a, b, dtype: torch.dtype, out=None):
    """a @ b accumulated and written in `dtype` (fp32; fp64 under gradcheck), whatever a's
    and b's dtype, so bf16 operands still give fp32 logits and gradients. On CUDA,
    torch.mm's out_dtype runs one bf16 tensor-core GEMM that writes its fp32 accumulator
    unrounded. torch 2.13 has that kernel on CUDA only, so elsewhere the operands are
    upcast first: every bf16 number is exact in fp32, so the result is the same up to the
    order of summation, only slower."""
    if a.is_cuda and a.dtype == torch.bfloat16 and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=dtype, out=out)
    return torch.mm(a.to(dtype), b.to(dtype), out=out)


def fused_ce_z_loss(hidden, weight, targets, z_loss: float, chunk_size: int,
                    ignore_index: int = -100, reduction: str = "mean", head_dtype: str = "fp32"):
    """reference_loss(hidden @ weight.T, targets, z_loss), the same number without the
    (N, V) logits (ChunkedCrossEntropyZLoss).

    hidden (N, C), weight (V, C), targets (N,). Returns (loss, ce, z): `loss` = ce + z is
    differentiable (gradients for hidden and weight, in their dtypes); `ce` and `z` are
    detached, for logging. "mean" divides by the number of non-ignored targets, "sum" does
    not (the trainer normalises by the global token count itself). `head_dtype` is
    TrainConfig.loss_head_dtype ("fp32" or "bf16": bf16 operands, fp32 accumulation).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
    return ChunkedCrossEntropyZLoss.apply(hidden, weight, targets, z_loss, chunk_size,
                                          ignore_index, reduction, head_dtype)
