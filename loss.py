"""The loss head at scale: model.py's `reference_loss` (cross-entropy + z-loss) of the
logits hidden @ weight.T, `chunk_size` rows at a time, so the (N, V) logits never exist
whole. At Stack-100M's 32 × 2,048 rows of V = 32,768 they would take 8 GiB in fp32, and
their gradient as much again: the loss head, not attention, dominates its memory. Forward
keeps each row's logsumexp; backward recomputes each chunk's logits, one extra matmul paid
in compute instead of memory (Cut Cross-Entropy, arXiv 2411.09009; Liger, arXiv 2410.10989).

Imports from stacklm: nothing.
"""

import torch


class ChunkedCrossEntropyZLoss(torch.autograd.Function):
    """Per row with logits l, softmax p, lse = logsumexp(l), target y and weight g
    (g = upstream grad × 1/N_valid for "mean", 0 on ignored rows):
        loss = g · (lse − l_y + z·lse²)
        dloss/dl = g · (p · (1 + 2z·lse) − onehot(y))
    head_dtype="bf16" rounds the matmuls' operands to bf16 (at most 2^-8 relative each); they
    still accumulate in fp32 (`head_matmul`), and logits, softmax and loss stay fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, z_loss, chunk_size, ignore_index, reduction,
                head_dtype):
        # Autocast would run the head matmul in bf16 and write bf16 logits.
        with torch.autocast(hidden.device.type, enabled=False):
            dtype = torch.promote_types(hidden.dtype, torch.float32)
            operand = torch.bfloat16 if head_dtype == "bf16" else dtype
            w = weight.to(operand)
            valid = targets != ignore_index
            safe_targets = targets.masked_fill(~valid, 0)  # any real index; masked below
            lse = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
            target_logit = torch.empty_like(lse)
            buffer = chunk_buffer(len(hidden), len(w), chunk_size, dtype, w.device)
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                h = hidden[rows].to(operand)
                logits = head_matmul(h, w.T, dtype, out=buffer[: h.shape[0]])  # (chunk, V)
                target_logit[rows] = logits.gather(1, safe_targets[rows, None]).squeeze(1)
                # logsumexp in place: torch.logsumexp would allocate a second (chunk, V).
                row_max = logits.amax(dim=-1, keepdim=True)
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
            w = weight.to(operand)
            valid = targets != ctx.ignore_index
            safe_targets = targets.masked_fill(~valid, 0)
            g = torch.where(valid, grad_loss / ctx.divisor, 0.0)  # (N,) each row's weight
            softmax_scale = g * (1 + 2 * ctx.z_loss * lse)  # (N,)
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
            buffer = chunk_buffer(len(hidden), len(w), ctx.chunk_size, dtype, w.device)
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                h = hidden[rows].to(operand)
                # In place, so one (chunk, V) buffer goes logits -> softmax -> dlogits.
                dlogits = head_matmul(h, w.T, dtype, out=buffer[: h.shape[0]])
                dlogits.sub_(lse[rows, None]).exp_()
                dlogits.mul_(softmax_scale[rows, None])
                dlogits.scatter_add_(1, safe_targets[rows, None], -g[rows, None])
                dlogits = dlogits.to(operand)  # a bf16 head rounds here
                grad_hidden[rows] = head_matmul(dlogits, w, dtype)
                if operand == dtype:
                    # In place; the out= form, unlike addmm_, is seen by FlopCounterMode.
                    torch.addmm(grad_weight, dlogits.T, h, out=grad_weight)
                else:  # CUDA's bf16 addmm cannot add into fp32: the product, then the sum
                    grad_weight += head_matmul(dlogits.T, h, dtype)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def chunk_buffer(n: int, vocab: int, chunk_size: int, dtype: torch.dtype, device):
    """One (chunk, V) buffer for every chunk: on CPU a fresh one per chunk is slower, its new
    pages faulted in (docs/figures.md)."""
    return torch.empty(min(chunk_size, n), vocab, dtype=dtype, device=device)


def head_matmul(a, b, dtype: torch.dtype, out=None):
    """a @ b accumulated and written in `dtype` (fp32; fp64 under gradcheck) whatever a's and
    b's dtype. torch.mm's out_dtype (one bf16 GEMM, fp32 out) is CUDA's only in torch 2.13;
    elsewhere the operands are upcast first, exactly, as bf16 is exact in fp32."""
    if a.is_cuda and a.dtype == torch.bfloat16 and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=dtype, out=out)
    return torch.mm(a.to(dtype), b.to(dtype), out=out)


def fused_ce_z_loss(hidden, weight, targets, z_loss: float, chunk_size: int,
                    ignore_index: int = -100, reduction: str = "mean", head_dtype: str = "fp32"):
    """reference_loss(hidden @ weight.T, targets, z_loss) without the (N, V) logits: hidden
    (N, C), weight (V, C), targets (N,) -> (loss, ce, z), `loss` = ce + z differentiable, `ce`
    and `z` detached for logging. "mean" divides by the non-ignored targets' count; "sum"
    leaves that to the trainer (the global token count). head_dtype: "fp32" or "bf16"."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
    return ChunkedCrossEntropyZLoss.apply(hidden, weight, targets, z_loss, chunk_size,
                                          ignore_index, reduction, head_dtype)
