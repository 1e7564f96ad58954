"""The Transformer: a Llama-style decoder for pretraining, written to be read top to bottom.
Stack-100M (config.StackConfig's defaults) and the 4M `tiny` model are two shapes of it.

A token's path through the model:

    embed ─► n_layers × Block ─► RMSNorm ─► head (= embed.weight, tied) ─► CE + z-loss
               │
               ├─ x + attention(RMSNorm(x))   grouped-query, QK-norm, RoPE (none on NoPE layers)
               └─ x + SwiGLU(RMSNorm(x))

A packed row holds several documents: `position_ids` restart at 0 for each, and `seq_ids`
name each token's document, which attention never leaves.

Shapes: B batch, T tokens in a row, S keys (T, or the cache when generating), C d_model,
H query heads, K key/value heads, D head dim, V vocabulary, N = B·T rows of the loss head.

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
    """x · rsqrt(mean(x²) + eps) · weight over the last dim (arXiv 1910.07467): LayerNorm
    without the mean and bias, cheaper and as good. In fp32 (bf16 loses the small
    components), the result in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        rms = torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)  # (..., 1)
        return (x32 * rms * self.weight.float()).type_as(x)


def rope_cos_sin(position_ids, head_dim: int, theta: float):
    """cos and sin of each token's rotary angles (RoFormer, arXiv 2104.09864), from
    `position_ids`, which restart in each packed document. In fp32: at position 2,000 a
    bf16 angle would be off by several radians."""
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device,
                             dtype=torch.float32) / head_dim
    inv_freq = theta ** -exponents  # (D/2,)
    angles = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate each pair (x[i], x[i + D/2]) of every head by its angle (Llama's halves, not
    neighbours: the same rotation up to a permutation the projections learn around)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, H, D/2) each
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, D/2): same for every head
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, T, H, D)
    return rotated.type_as(x)


def uses_rope(cfg: StackConfig, layer: int) -> bool:
    """False on every nope_every-th layer counted from 1 (4, 8, 12, … by default). NoPE layers
    (arXiv 2305.19466) know token order through the causal mask; mixed with RoPE layers they
    help length generalisation (as in Llama 4 and SmolLM3)."""
    return not (cfg.nope_every > 0 and (layer + 1) % cfg.nope_every == 0)


# ---------------------------------------------------------------------------------------
# Attention: one chooser, three kernels
# ---------------------------------------------------------------------------------------

@functools.cache
def compiled_kernel(kernel, **options):
    """torch.compile(kernel), made on first use (only the CUDA path needs the compiler).
    Eager flex_attention materialises the (T, T) scores, and eager create_block_mask B·T²
    int64 temporaries; compiled, each is one fused kernel (as torchtitan does)."""
    return torch.compile(kernel, **options)


def attention_backend(device: torch.device, has_seq_ids: bool) -> str:
    """Which kernel runs attention: "sdpa_causal" without document ids; for packed
    documents "flex" on CUDA (a block-sparse mask skips other documents' blocks), else
    "sdpa_dense", an explicit (T, T) mask (flex_attention has no CPU backward in torch 2.13).
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
    """q (B, H, T, D), k and v (B, K, S, D) -> (B, H, T, D). `mask`: None (causal), a boolean
    (B, 1, T, S) or (T, S), or a BlockMask. Query head h reads key/value head h // (H / K)
    (arXiv 2305.13245), enable_gqa doing so without copying k and v."""
    if isinstance(mask, BlockMask):
        # A compiled block compiles flex_attention with itself (a compiled copy called there
        # may be silently wrong, dynamo warns); called eagerly, it needs a compiled copy.
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
    """Grouped-query self-attention (arXiv 2305.13245) with QK-norm (arXiv 2302.05442): RMSNorm
    on each head's q and k, before RoPE, bounds the attention logits, which otherwise grow
    in long, high-learning-rate runs."""

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
    """Pre-norm residual block, on plain tensors so each block compiles and shards alone.
    `recompute` (TrainConfig.activation_recompute) trades compute for memory: "none" keeps
    every activation, "full" only the block's input (~1/3 more compute), "selective" what
    `selective_recompute` names. It runs inside `forward`, so compile and FSDP2 see it."""

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
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.higher_order.flex_attention,
}


def selective_recompute():
    """What a block keeps under activation_recompute=selective (torchtitan's "op" policy):
    attention's output and every other matmul's (q_proj, v_proj, gate_proj, down_proj);
    the rest (k_proj, o_proj, up_proj, norms, RoPE, SiLU) is recomputed. Made anew for each
    block's forward, so each block counts its own matmuls, and its recomputation apart."""
    matmuls = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op == aten.mm.default:
            # torch 2.11 asks the policy again as it recomputes (2.13 replays the forward's
            # answers): a count of its own finds the same kept matmuls there.
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
# The logits' precision, in every head: the loss is computed in fp32, from the logits the
# head's matmul writes: the plain head's in the blocks' precision (bf16 under autocast, as
# nanoGPT's), the chunked head's and those scoring and sampling read in fp32.


class Loss(NamedTuple):
    """What a training forward returns: `loss` = ce + z, the one to differentiate, and its
    two parts, detached, for logging. Each is a mean or a sum over the non-ignored targets."""
    loss: torch.Tensor
    ce: torch.Tensor
    z: torch.Tensor


def reference_loss(logits, targets, z_loss: float, ignore_index: int = -100,
                   reduction: str = "mean") -> Loss:
    """The training loss of logits (N, V), any dtype, and targets (N,). Per row with lse =
    logsumexp(l): ce = lse − l_y in nats, and z = z_loss·lse², PaLM's z-loss (arXiv
    2204.02311, §5), which keeps the softmax normaliser near 1 and the logits from drifting
    in bf16. Summed over the targets that are not ignore_index ("mean": divided by their
    number); "none" keeps each target's (N,), for scoring."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32
    kept = targets != ignore_index
    at_target = targets.masked_fill(~kept, 0)[:, None]  # (N, 1); any real index where ignored
    log_probs = F.log_softmax(logits, dim=-1)  # (N, V): l − lse
    log_p = log_probs.gather(1, at_target).squeeze(1)  # (N,): l_y − lse
    lse = logits.gather(1, at_target).squeeze(1) - log_p  # (N,)
    ce = torch.where(kept, -log_p, 0.0)
    z = torch.where(kept, z_loss * lse.square(), 0.0)
    if reduction == "none":
        return Loss(ce + z, ce.detach(), z.detach())
    ce, z = ce.sum(), z.sum()
    n = kept.sum().clamp(min=1) if reduction == "mean" else 1
    return Loss((ce + z) / n, ce.detach() / n, z.detach() / n)


def fp32_logits(hidden, weight):
    """hidden (..., C) @ weight.T (V, C) -> (..., V) logits in fp32 whatever autocast says
    (on CUDA TF32, launch.py's matmul precision "high")."""
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), weight.float())


# Rows of logits the plain head's loss takes at once: 256 × V fp32 for tiny's V = 4,096 is
# 4 MiB, which stays in a CPU's cache between the passes over it.
PLAIN_ROWS = 256


def plain_head_loss(hidden, weight, targets, z_loss: float, reduction: str) -> Loss:
    """The plain head: the tied embedding's logits (N, V) in the blocks' precision, into
    reference_loss PLAIN_ROWS rows at a time (each row's loss is its own): a chunk's fp32
    copy, softmax and gradient stay in a CPU's cache (docs/figures.md)."""
    logits = F.linear(hidden, weight)  # (N, V)
    sums = [reference_loss(rows, rows_targets, z_loss, reduction="sum")
            for rows, rows_targets in zip(logits.split(PLAIN_ROWS), targets.split(PLAIN_ROWS),
                                          strict=True)]
    n = (targets != -100).sum().clamp(min=1) if reduction == "mean" else 1
    return Loss(*(torch.stack(part).sum() / n for part in zip(*sums, strict=True)))


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Decoder-only transformer; the LM head is the embedding matrix (tied, arXiv 1608.05859).
    The trainer sets each block's `recompute` and `loss_head_dtype` from TrainConfig."""

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
        - embed.weight, also the LM head: normal(0, s), GPT-2's choice: with unit-RMS hidden
          states the first logits have std s·√C ≈ 0.45, so the first loss is ≈ ln V.
        - q_proj, k_proj, v_proj, gate_proj, up_proj: normal(0, s).
        - o_proj, down_proj, the 2L writes into the residual stream: normal(0, s/√(2L)), so
          the residual's variance does not grow with depth (GPT-2 §2.3; arXiv 1909.08053).
        - every RMSNorm gain: ones, so each norm starts as pure normalisation."""
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
        """(B, T) integer tensors -> Loss: the mean or "sum" over the non-ignored targets, or
        ("none", for scoring) each target's own numbers."""
        x = self.hidden_states(input_ids, position_ids, seq_ids).flatten(0, 1)  # (N, C)
        targets = targets.flatten()  # (N,)
        if reduction != "none" and not self.cfg.ce_chunk_size:
            return self.plain_head(x, targets, reduction)
        if reduction != "none":
            # loss.py's chunked head: the same number without the (N, V) logits.
            return Loss(*fused_ce_z_loss(x, self.embed.weight, targets, self.cfg.z_loss,
                                         self.cfg.ce_chunk_size, reduction=reduction,
                                         head_dtype=self.loss_head_dtype))
        # Scoring (downstream.py): each target's numbers, ce_chunk_size rows at a time.
        rows = self.cfg.ce_chunk_size or len(x)
        parts = [reference_loss(fp32_logits(h, self.embed.weight), t, self.cfg.z_loss,
                                reduction="none")
                 for h, t in zip(x.split(rows), targets.split(rows), strict=True)]
        return Loss(*(torch.cat(part) for part in zip(*parts, strict=True)))

    def plain_head(self, hidden, targets, reduction: str) -> Loss:
        return plain_head_loss(hidden, self.embed.weight, targets, self.cfg.z_loss, reduction)

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
        """input_ids (B, T0) -> (B, T0 + max_new_tokens). The prompt runs once, filling a
        KVCache per layer; each later step feeds only the newest token."""
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
    """The root's parameters (tied embedding, final norm), gathered for `generate` and
    `logits`: under FSDP2 only a module's forward gathers them, and these run outside it."""
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
    """One completion of `prompt` as text, opened with eos_id as every training document
    is, and cut where the model generates it."""
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
    """Training FLOPs per token at s = seq_len: 6 per matmul parameter (2 forward, 4
    backward), and attention's 12·s·d_q per layer (d_q = H·D), with
    - "causal": 6·N + 6·L·s·d_q (Kaplan et al., arXiv 2001.08361, §2.1), N all parameters,
      attention halved by the causal mask;
    - "palm": 6·N_matmul + 12·L·d_q·s (PaLM's appendix B, arXiv 2204.02311; torchtitan's MFU).
    """
    L, d_q = cfg.n_layers, cfg.n_heads * cfg.head_size
    if convention == "causal":
        return 6 * count_params(cfg) + 6 * L * seq_len * d_q
    if convention == "palm":
        return 6 * count_matmul_params(cfg) + 12 * L * d_q * seq_len
    raise ValueError(f"convention={convention!r} must be 'causal' or 'palm'")
