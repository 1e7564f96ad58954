"""The Transformer: a Llama-style decoder for pretraining, written to be read top to bottom.
Stack-100M (config.StackConfig's defaults) and the 4M `tiny` model are two shapes of it.

A token's path through the model:

    embed ─► n_layers × Block ─► RMSNorm ─► head (= embed.weight, tied) ─► CE + z-loss
               │
               ├─ x + attention(RMSNorm(x))   grouped-query, QK-norm, RoPE (none on NoPE layers)
               └─ x + SwiGLU(RMSNorm(x))

Training batches are packed: one row holds several documents. `position_ids` restart at 0
for each document (RoPE sees positions inside the document) and `seq_ids` name the
document of each token (attention never crosses a document boundary).

Shape letters: B batch, T tokens in a row, S keys (T, or the cache length when
generating), C model width (d_model), H query heads, K key/value heads, D head dim,
V vocabulary, N = B·T rows of the loss head.

Imports from stacklm: config (the model's shape) and loss (the chunked loss head).
"""

import contextlib
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from config import StackConfig
from loss import fused_ce_z_loss

# ---------------------------------------------------------------------------------------
# Normalisation and rotary position embedding
# ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (arXiv 1910.07467): LayerNorm without the
    mean subtraction and bias, which costs less and trains as well.

        RMSNorm(x) = x · rsqrt(mean(x²) + eps) · weight   over the last dim

    The mean of squares is taken in fp32 (in bf16 it loses the small components), and the
    result is in x's dtype. A compiled block fuses these ops and their backward."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        rms = torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)  # (..., 1)
        return (x32 * rms * self.weight.float()).type_as(x)


def rope_cos_sin(position_ids, head_dim: int, theta: float):
    """cos and sin of the rotary angles (RoFormer, arXiv 2104.09864) for each token.

    Computed from `position_ids` rather than sliced from a table by row index, so that
    positions restart at 0 for every packed document. Frequencies are in fp32: at
    position 2,000 a bf16 angle would be off by several radians.
    """
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device,
                             dtype=torch.float32) / head_dim
    inv_freq = theta ** -exponents  # (D/2,)
    angles = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate each pair (x[i], x[i + D/2]) of every head by its angle. Pairing the two halves
    (GPT-NeoX/Llama style) rather than neighbours is the same rotation up to a fixed
    permutation of the head dims, which the projections learn around."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, H, D/2) each
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, D/2): same for every head
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, T, H, D)
    return rotated.type_as(x)


def uses_rope(cfg: StackConfig, layer: int) -> bool:
    """Layer `layer` (0-indexed) has no positional encoding when nope_every > 0 and
    (layer + 1) % nope_every == 0, i.e. layers 4, 8, 12, … counted from 1 with the default
    nope_every=4. Such NoPE layers (arXiv 2305.19466) still know the order of tokens through
    the causal mask; mixing them with RoPE layers helps length generalisation (as in
    Llama 4 and SmolLM3)."""
    return not (cfg.nope_every > 0 and (layer + 1) % cfg.nope_every == 0)


# ---------------------------------------------------------------------------------------
# Attention: one chooser, three kernels
# ---------------------------------------------------------------------------------------

@functools.cache
def compiled_kernel(kernel, **options):
    """torch.compile(kernel), made on first use: only the CUDA path runs these, and the
    first torch.compile imports the compiler (seconds a CPU run never needs). Eager
    flex_attention materialises the (T, T) score matrix; compiled, it is one fused kernel
    that skips the blocks the mask rules out. Building a BlockMask evaluates the mask rule
    for every (query, key) pair: eagerly that makes B·T² int64 temporaries (GiBs at
    32 × 2,048) on every forward; compiled, one fused kernel (as torchtitan does)."""
    return torch.compile(kernel, **options)


def attention_backend(device: torch.device, has_seq_ids: bool) -> str:
    """Which kernel runs attention.

    - "sdpa_causal": no document ids, so plain causal attention (a fused SDPA kernel).
    - "flex": packed documents on CUDA; compiled flex_attention with a block-sparse mask
      built from seq_ids, so blocks of other documents are skipped, not computed.
    - "sdpa_dense": packed documents on CPU; flex_attention has no CPU backward in
      torch 2.13, so SDPA takes an explicit (T, T) boolean mask.
    """
    if not has_seq_ids:
        return "sdpa_causal"
    return "flex" if torch.device(device).type == "cuda" else "sdpa_dense"


def document_dense_mask(seq_ids):
    """True where query t may attend to key s: same document and s <= t."""
    T = seq_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seq_ids.device).tril()  # (T, T)
    same_doc = seq_ids[:, :, None] == seq_ids[:, None, :]  # (B, T, T)
    return (same_doc & causal)[:, None]  # (B, 1, T, T): broadcast over heads


def document_block_mask(seq_ids) -> BlockMask:
    """The same rule as `document_dense_mask`, as flex_attention's block-sparse BlockMask."""
    B, T = seq_ids.shape

    def same_document_causal(b, h, q_idx, kv_idx):
        return (seq_ids[b, q_idx] == seq_ids[b, kv_idx]) & (q_idx >= kv_idx)

    build = compiled_kernel(create_block_mask) if seq_ids.is_cuda else create_block_mask
    return build(same_document_causal, B, None, T, T, device=seq_ids.device)


def attention_mask(seq_ids, device) -> BlockMask | torch.Tensor | None:
    """Build the mask once per forward, in the form the chosen kernel takes."""
    backend = attention_backend(device, seq_ids is not None)
    if backend == "flex":
        return document_block_mask(seq_ids)
    if backend == "sdpa_dense":
        return document_dense_mask(seq_ids)
    return None


def attention(q, k, v, mask):
    """Softmax attention; q (B, H, T, D), k and v (B, K, S, D) -> (B, H, T, D).

    `mask` is None (causal), a boolean tensor broadcast to (B, H, T, S) — (B, 1, T, S) for
    packed documents, (T, S) when generating with a cache — or a BlockMask. Query head h
    reads key/value head h // (H / K) (grouped-query attention, arXiv 2305.13245): the
    kernels' enable_gqa does this without copying k and v H / K times.
    """
    if isinstance(mask, BlockMask):
        # Inside a compiled block, dynamo compiles flex_attention with the rest of the block
        # (a cached compiled copy called there is traced as an opaque function, which dynamo
        # warns may be silently wrong); called eagerly, it needs a compiled copy of its own.
        flex = flex_attention if torch.compiler.is_compiling() else \
            compiled_kernel(flex_attention, dynamic=False)
        return flex(q, k, v, block_mask=mask, enable_gqa=True)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class KVCache:
    """One layer's keys and values for every position generated so far."""

    def __init__(self):
        self.k = self.v = None

    def append(self, k, v):
        """k, v (B, K, T, D) of the new tokens -> all keys and values (B, K, S, D)."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class Attention(nn.Module):
    """Grouped-query self-attention (arXiv 2305.13245) with QK-norm (arXiv 2302.05442).

    QK-norm: RMSNorm on each head's q and k bounds the attention logits, which removes
    the logit-growth instability of long, high-learning-rate runs. It is applied before
    RoPE so the rotation acts on unit-scale vectors.
    """

    def __init__(self, cfg: StackConfig, use_rope: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_size = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
        self.use_rope = use_rope
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_size, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_size, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_size, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_size, cfg.d_model, bias=False)
        norm = (lambda: RMSNorm(cfg.head_size, cfg.norm_eps)) if cfg.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, x, cos, sin, mask, kv_cache: KVCache | None = None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_size)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_size)  # (B, T, K, D)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_size)  # (B, T, K, D)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, D)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, K, S, D)
        y = attention(q, k, v, mask)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_size)  # (B, T, H·D)
        return self.o_proj(y)  # (B, T, C)


class SwiGLU(nn.Module):
    """Gated MLP, down(silu(gate(x)) · up(x)) (Shazeer, arXiv 2002.05202). Three matrices
    of width `intermediate` ≈ 2.75·C cost what two of width 4·C would."""

    def __init__(self, d_model: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, intermediate, bias=False)
        self.up_proj = nn.Linear(d_model, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block. Takes plain tensors (and the mask built once per forward) so
    the trainer can torch.compile and FSDP-shard each block on its own.

    `recompute` trades compute for memory (activation recomputation, also called activation
    checkpointing): "none" keeps every activation backward needs; "full" keeps only the
    block's input and recomputes the rest in backward (~1/3 more compute); "selective" keeps
    what `selective_recompute` names and recomputes the rest. The trainer sets it from
    TrainConfig.activation_recompute. The recomputation runs inside `forward`, so a compiled
    block compiles it too, and FSDP2 gathers the block's weights for it as for the forward."""

    def __init__(self, cfg: StackConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, use_rope=uses_rope(cfg, layer))
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.intermediate)
        self.recompute = "none"

    def forward(self, x, cos, sin, mask, kv_cache: KVCache | None = None):
        if self.recompute == "none" or not torch.is_grad_enabled():
            return self.residual(x, cos, sin, mask, kv_cache)
        if self.recompute == "full":
            return torch.utils.checkpoint.checkpoint(self.residual, x, cos, sin, mask,
                                                     use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(self.residual, x, cos, sin, mask,
                                                 use_reentrant=False,
                                                 context_fn=selective_recompute)

    def residual(self, x, cos, sin, mask, kv_cache: KVCache | None = None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, kv_cache)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


# Attention's kernels, as autograd sees them on each device: selective recomputation keeps
# their outputs (recomputing attention costs as much as computing it).
aten = torch.ops.aten
ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # SDPA on a CPU
    aten._scaled_dot_product_flash_attention.default,  # SDPA on CUDA
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.higher_order.flex_attention,  # packed documents on CUDA
}


def selective_recompute():
    """What a block keeps for backward under activation_recompute=selective (torchtitan's
    "op" policy): the outputs of the expensive ops, attention and every other matmul (the
    1st, 3rd, 5th and 7th: q_proj, v_proj, gate_proj, down_proj); everything else is
    recomputed in backward: the other matmuls (k_proj, o_proj, up_proj), and the norms,
    RoPE, SiLU and casts, elementwise work that costs little to redo. Made anew for each
    block's forward, so each counts its own matmuls (a count shared by all blocks would
    keep other matmuls in each: torchtitan #3397); its recomputation counts apart from its
    forward, and finds the kept outputs by the same count."""
    matmuls = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op == aten.mm.default:
            count = "recompute" if ctx.is_recompute else "forward"
            matmuls[count] += 1
            keep = matmuls[count] % 2 == 1
        else:
            keep = op in ATTENTION_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


# ---------------------------------------------------------------------------------------
# The loss: cross-entropy + z-loss (the chunked head at scale: loss.py)
# ---------------------------------------------------------------------------------------
# The logits' precision, in every head: the loss (logsumexp, softmax, CE, z-loss) is computed
# in fp32. The logits it reads are what the head's matmul writes: the plain head's in the
# blocks' precision (bf16 under autocast, as nanoGPT's head), the chunked head's, and those
# scoring and sampling read, in fp32 (`fp32_logits`; loss.py's matmul accumulates in fp32).


class Loss(NamedTuple):
    """What a training forward returns: `loss` = ce + z, the one to differentiate, and its
    two parts, detached, for logging. Each is a mean or a sum over the non-ignored targets."""
    loss: torch.Tensor
    ce: torch.Tensor
    z: torch.Tensor


def reference_loss(logits, targets, z_loss: float, ignore_index: int = -100,
                   reduction: str = "mean") -> Loss:
    """The training loss. logits (N, V) in any dtype, targets (N,).

    Per row with logits l, target y and lse = logsumexp(l): ce = lse − l_y, the
    cross-entropy of the target (in nats), and z = z_loss·lse², PaLM's z-loss (arXiv
    2204.02311, §5), which keeps the softmax normaliser near 1 and the logits from drifting
    in bf16. One log-softmax serves both terms. Both are summed over the targets that are
    not ignore_index and, for "mean", divided by their number; "none" keeps one number per
    target (N,), for scoring (downstream.py sums a choice's). loss.py's chunked head
    computes the same numbers without the (N, V) logits."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32
    kept = targets != ignore_index  # (N,)
    at_target = targets.masked_fill(~kept, 0)[:, None]  # (N, 1); any real index where ignored
    log_probs = F.log_softmax(logits, dim=-1)  # (N, V): l − lse
    log_p = log_probs.gather(1, at_target).squeeze(1)  # (N,): l_y − lse
    lse = logits.gather(1, at_target).squeeze(1) - log_p  # (N,)
    ce = torch.where(kept, -log_p, 0.0)  # (N,), 0 where ignored
    z = torch.where(kept, z_loss * lse.square(), 0.0)  # (N,)
    if reduction == "none":
        return Loss(ce + z, ce.detach(), z.detach())
    ce, z = ce.sum(), z.sum()
    n = kept.sum().clamp(min=1) if reduction == "mean" else 1
    return Loss((ce + z) / n, ce.detach() / n, z.detach() / n)


def fp32_logits(hidden, weight):
    """hidden (..., C) @ weight.T (V, C) -> (..., V) fp32 logits: the matmul in fp32 whatever
    autocast says (on CUDA on TF32 tensor cores, launch.py's matmul precision "high"), and
    with fp32 operands (under FSDP2's bf16 they arrive rounded, as the chunked head's do)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), weight.float())


# Rows of logits the plain head's loss takes at once: 256 × V fp32 for tiny's V = 4,096 is
# 4 MiB, which stays in a CPU's cache between the passes over it.
PLAIN_ROWS = 256


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Decoder-only transformer; the LM head is the embedding matrix (tied, arXiv 1608.05859).

    The trainer sets each block's `recompute` (Block) and `loss_head_dtype` ("fp32" or
    "bf16", the loss head's matmul operands) from TrainConfig.
    """

    def __init__(self, cfg: StackConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)  # also the LM head
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.loss_head_dtype = "fp32"
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Initialise every tensor; s = cfg.init_std (0.02), L = cfg.n_layers.

        - embed.weight (V, C), also the LM head: normal(0, s), GPT-2's choice (Radford et
          al. 2019). With unit-RMS hidden states the first logits have std s·√C ≈ 0.45, so
          the first loss is ≈ ln V.
        - q_proj, k_proj, v_proj, gate_proj, up_proj: normal(0, s).
        - o_proj, down_proj, the two matrices of each block that write into the residual
          stream: normal(0, s/√(2L)). There are 2L such writes: each adds variance in
          proportion to s²/(2L) rather than s², so the residual grows far more slowly with
          depth than it would at s (GPT-2 §2.3; Megatron-LM's "scaled init", arXiv
          1909.08053).
        - every RMSNorm gain (attn_norm, mlp_norm, q_norm, k_norm, the final norm): ones,
          so each norm starts as pure normalisation.
        """
        std, residual_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.embed.weight, std=std)
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                nn.init.normal_(linear.weight, std=std)
            for linear in (attn.o_proj, mlp.down_proj):
                nn.init.normal_(linear.weight, std=residual_std)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, input_ids, targets, position_ids=None, seq_ids=None,
                reduction="mean") -> Loss:
        """input_ids, targets, position_ids, seq_ids: (B, T) integer tensors -> Loss(loss, ce,
        z): CE + z-loss over the non-ignored targets, their mean or (reduction="sum") sum; or
        (reduction="none", for scoring) each target's own numbers."""
        x = self.hidden_states(input_ids, position_ids, seq_ids).flatten(0, 1)  # (N, C)
        targets = targets.flatten()  # (N,)
        if reduction != "none" and not self.cfg.ce_chunk_size:
            return self.plain_head(x, targets, reduction)
        if reduction != "none":
            # loss.py's chunked head: the same number without the (N, V) logits,
            # ce_chunk_size rows at a time, the head at scale.
            return Loss(*fused_ce_z_loss(x, self.embed.weight, targets, self.cfg.z_loss,
                                         self.cfg.ce_chunk_size, reduction=reduction,
                                         head_dtype=self.loss_head_dtype))
        # Scoring (downstream.py, no gradient): each target's (N,) numbers, ce_chunk_size
        # rows of logits at a time (this forward, not `logits`, which holds all (B, T, V)).
        rows = self.cfg.ce_chunk_size or len(x)
        parts = [reference_loss(fp32_logits(h, self.embed.weight), t, self.cfg.z_loss,
                                reduction="none")  # (rows, V) logits -> (rows,) each
                 for h, t in zip(x.split(rows), targets.split(rows), strict=True)]
        return Loss(*(torch.cat(part) for part in zip(*parts, strict=True)))

    def plain_head(self, hidden, targets, reduction: str) -> Loss:
        """The plain head: the tied embedding turns each hidden state (N, C) into V logits,
        in the blocks' matmul precision, and reference_loss takes them in fp32, PLAIN_ROWS
        rows at a time (each row's loss is its own, so the sum is the same): a chunk's fp32
        copy, softmax and gradient stay in a CPU's cache (docs/figures.md)."""
        logits = F.linear(hidden, self.embed.weight)  # (N, V)
        sums = [reference_loss(rows, rows_targets, self.cfg.z_loss, reduction="sum")
                for rows, rows_targets in zip(logits.split(PLAIN_ROWS),
                                              targets.split(PLAIN_ROWS), strict=True)]
        n = (targets != -100).sum().clamp(min=1) if reduction == "mean" else 1
        return Loss(*(torch.stack(part).sum() / n for part in zip(*sums, strict=True)))

    def logits(self, input_ids, position_ids=None, seq_ids=None, last_only=False):
        """fp32 logits (B, T, V), or (B, 1, V) of the last position with last_only."""
        with root_gathered(self):
            x = self.hidden_states(input_ids, position_ids, seq_ids)  # (B, T, C)
            x = x[:, -1:] if last_only else x  # (B, 1 or T, C)
            return fp32_logits(x, self.embed.weight)  # (B, 1 or T, V)

    def hidden_states(self, input_ids, position_ids, seq_ids):
        """The final-norm hidden states (B, T, C) that the head turns into logits."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_size, self.cfg.rope_theta)
        mask = attention_mask(seq_ids, input_ids.device)
        x = self.embed(input_ids)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.norm(x)  # (B, T, C)

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None):
        """Extend each row of input_ids (B, T0) by max_new_tokens sampled tokens -> (B, T0+n).

        The prompt is run once, filling one KVCache per layer; each later step feeds only
        the newest token, at position T0 + i. temperature=0 is greedy decoding.
        """
        total = input_ids.shape[1] + max_new_tokens
        if total > self.cfg.max_seq_len:
            raise ValueError(f"prompt of {input_ids.shape[1]} tokens + max_new_tokens="
                             f"{max_new_tokens} exceeds max_seq_len={self.cfg.max_seq_len}; "
                             f"shorten one of them")
        caches = [KVCache() for _ in self.blocks]
        # Eager, even where the blocks are compiled: each step's new cache length, batch and
        # grad mode would make them compile again and again (nanochat samples uncompiled too).
        with torch.compiler.set_stance("force_eager"), root_gathered(self):
            logits = self.forward_cached(input_ids, 0, caches)
            tokens = input_ids
            for step in range(max_new_tokens):
                next_token = sample_next_token(logits[:, -1], temperature, top_k)  # (B, 1)
                tokens = torch.cat([tokens, next_token], dim=1)
                if step + 1 < max_new_tokens:
                    logits = self.forward_cached(next_token, tokens.shape[1] - 1, caches)
        return tokens

    def forward_cached(self, input_ids, start: int, caches: list[KVCache]):
        """Run tokens at positions start, start+1, … given the cached earlier ones -> logits
        (B, T, V). The new queries see every cached key and, causally, each other."""
        B, T = input_ids.shape
        position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_size, self.cfg.rope_theta)
        mask = torch.ones(T, start + T, dtype=torch.bool,
                          device=input_ids.device).tril(diagonal=start)  # (T, S)
        x = self.embed(input_ids)  # (B, T, C)
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block(x, cos, sin, mask, cache)
        return fp32_logits(self.norm(x), self.embed.weight)  # (B, T, V)


@contextlib.contextmanager
def root_gathered(model: Transformer):
    """`generate` and `logits` use the root's own parameters (the tied embedding, the final
    norm) outside `forward`. Under FSDP2 (`fully_shard`) only a module's forward gathers its
    parameters, so these would meet a DTensor shard: gather the root's group for the
    duration (each block still gathers its own in its forward). Unsharded: nothing to do."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


# Sampling defaults of sample.py and of the end-of-run sample, so that both read alike.
TEMPERATURE, TOP_K = 0.8, 50


def complete(model, tokenizer, prompt: str, max_new_tokens: int,
             temperature: float = TEMPERATURE, top_k: int | None = TOP_K, *, eos_id: int) -> str:
    """One completion of `prompt` as text (`tokenizer` is the model's `tokenizers.Tokenizer`,
    eos_id the token that opens each document in its data), opened with it as every
    training document is, and cut where the model generates it."""
    ids = [eos_id] + tokenizer.encode(prompt).ids
    device = model.embed.weight.device
    tokens = model.generate(torch.tensor([ids], device=device), max_new_tokens,
                            temperature=temperature, top_k=top_k)[0].tolist()
    new = tokens[len(ids):]
    if eos_id in new:
        new = new[:new.index(eos_id)]
    return tokenizer.decode(ids[1:] + new)


def sample_next_token(logits, temperature: float, top_k: int | None):
    """logits (B, V) -> token ids (B, 1): greedy at temperature 0, else sampled from
    softmax(logits / temperature), restricted to the top_k most likely tokens if given."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1)


# ---------------------------------------------------------------------------------------
# Parameter and FLOP accounting
# ---------------------------------------------------------------------------------------


def count_params(model_or_cfg: nn.Module | StackConfig) -> int:
    """Parameters of a model (each shared tensor once) or, analytically, of a config."""
    if isinstance(model_or_cfg, nn.Module):
        return sum(p.numel() for p in model_or_cfg.parameters())
    return count_matmul_params(model_or_cfg) + count_norm_params(model_or_cfg)


def count_norm_params(cfg: StackConfig) -> int:
    """RMSNorm gains: two per block, q and k norms if enabled, the final norm."""
    qk = 2 * cfg.head_size if cfg.qk_norm else 0
    return cfg.n_layers * (2 * cfg.d_model + qk) + cfg.d_model


def count_matmul_params(cfg: StackConfig) -> int:
    """Parameters that take part in a matmul: every projection, and the tied embedding
    once (as the LM head; the lookup itself is free)."""
    C, D = cfg.d_model, cfg.head_size
    attention_ = C * D * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)  # q, o and k, v
    mlp = 3 * C * cfg.intermediate
    return cfg.n_layers * (attention_ + mlp) + cfg.vocab_size * C


def flops_per_token(cfg: StackConfig, seq_len: int, convention: str = "causal") -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`.

    Each matmul parameter costs 2 FLOPs per token forward and 4 backward: 6 in all.
    Attention's scores and weighted sum cost 4·s·d_q per token per layer forward, 12
    with backward, where d_q = H·D.
    - "causal": 6·N + 6·L·s·d_q, the count of Kaplan et al. (arXiv 2001.08361, §2.1) with N
      all parameters, the tied embedding once: the attention term is halved because a
      causal mask needs only half the scores.
    - "palm": 6·N_matmul + 12·L·H·D·s, PaLM's appendix B (arXiv 2204.02311) and torchtitan's
      MFU convention: the full, unmasked attention cost.
    """
    L, d_q = cfg.n_layers, cfg.n_heads * cfg.head_size
    if convention == "causal":
        return 6 * count_params(cfg) + 6 * L * seq_len * d_q
    if convention == "palm":
        return 6 * count_matmul_params(cfg) + 12 * L * d_q * seq_len
    raise ValueError(f"convention={convention!r} must be 'causal' or 'palm'")
