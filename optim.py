"""Optimizers and the learning-rate schedule.

- `Muon` updates the hidden weight matrices: momentum, then an orthogonalised step (Jordan
  et al. 2024, https://kellerjordan.github.io/posts/muon/), with Moonlight's weight decay
  and AdamW-matched step size (Liu et al. 2025, arXiv 2502.16982).
- `build_optimizers` routes the hidden matrices to Muon, the tied embedding/head and the
  1-D gains to AdamW; `Optimizers` steps the two as one.
- `lr_multiplier` is the warmup-stable-decay (WSD) schedule (Hu et al. 2024, MiniCPM, arXiv
  2404.06395), a pure function of the step; its layout and checks are config.py's.

Imports from stacklm: config (the schedule's layout).
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from config import format_phases, wsd_phases

# ---------------------------------------------------------------------------------------
# Muon
# ---------------------------------------------------------------------------------------

# Quintic Newton–Schulz coefficients from Jordan et al. 2024, chosen so that small singular
# values grow as fast as possible (slope a at zero) while none leaves a band around 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype=torch.float32) -> torch.Tensor:
    """G = U S Vᵀ, one (A, B) matrix or a stack (N, A, B) -> ≈ U Vᵀ, in G's dtype. Each
    iteration X ← aX + b(XXᵀ)X + c(XXᵀ)²X maps every singular value s to a·s + b·s³ + c·s⁵
    and leaves U and V alone. After 5 steps they lie in roughly [0.68, 1.15], not at 1,
    which Jordan et al. found trains as well as the exact U Vᵀ."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the short side: XXᵀ is then min(A, B)² instead of max(A, B)²
        X = X.mT
    # Frobenius ≥ spectral norm: singular values start in [0, 1], which the polynomial maps up.
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    matmul_add = torch.baddbmm if X.ndim == 3 else torch.addmm
    for _ in range(steps):
        gram = X @ X.mT
        polynomial = matmul_add(gram, gram, gram, beta=b, alpha=c)  # b·gram + c·gram²
        X = matmul_add(X, polynomial, X, beta=a)
    return (X.mT if tall else X).to(G.dtype)


LR_SCALES = {
    "original": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
}


def lr_scale(rows: int, cols: int, adjust_lr: str) -> float:
    """Muon's step on a (rows x cols) matrix relative to the lr. An orthogonal update's RMS
    entry is 1/sqrt(max(A, B)), smaller for a wide MLP matrix than a square one.
    - "original" (Jordan et al. 2024): sqrt(max(1, A/B)), an RMS-to-RMS norm of 1.
    - "match_rms_adamw" (Moonlight, arXiv 2502.16982, Sec. 2.2): 0.2·sqrt(max(A, B)), an
      update RMS of 0.2 for every matrix, the typical RMS of an AdamW update.
    """
    return LR_SCALES[adjust_lr](rows, cols)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds: a DTensor's local shard (a view: in-place ops write through
    under no_grad), or a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton–Schulz (Jordan et al. 2024), for 2-D weights only.

    Per matrix W with gradient G, momentum μ and learning rate lr:
        M ← μ·M + (1 − μ)·G                      momentum as an EMA (as torch.optim.Muon)
        U ← (1 − μ)·G + μ·M  (Nesterov) or M     look ahead along the momentum
        O ← NewtonSchulz(U)                      ≈ the nearest semi-orthogonal matrix
        W ← W·(1 − lr·weight_decay)              decoupled decay with the unadjusted lr
        W ← W − lr·lr_scale(A, B)·O              shape-dependent step size

    Orthogonalising equalises the update's singular values, so directions the gradient
    barely touches still move. Without weight decay Muon's weights grow too large over a
    long run (Moonlight). With "match_rms_adamw" the two optimizers' lrs are comparable, not
    equal: TrainConfig.muon_peak_lr=6e-3 is a starting point no run here has tuned.
    ns_dtype None runs Newton–Schulz in bf16 on GPUs (it tolerates bf16, tensor cores make
    it fast) and fp32 on CPUs, where only hardware bf16 pays (docs/figures.md).
    Same-shape matrices are orthogonalised as one batch; under FSDP2 each matrix whole, on
    its owner rank (below). Gradients arrive averaged by DDP/FSDP: Muon never reduces them.
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.1,
                 adjust_lr: str = "match_rms_adamw", ns_dtype: torch.dtype | None = None):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        weight_decay=weight_decay, adjust_lr=adjust_lr)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got shape {tuple(p.shape)}; "
                                     f"give embeddings and 1-D gains to AdamW")
        self.ns_dtype = ns_dtype
        # (group, positions) per shape. Positions, not tensors: accelerate.prepare and
        # load_state_dict replace the parameters and group dicts these would hold.
        self.shape_buckets = [
            (g, [i for i, p in enumerate(group["params"]) if p.shape == shape])
            for g, group in enumerate(self.param_groups)
            for shape in sorted({p.shape for p in group["params"]})]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, positions in self.shape_buckets:
            group = self.param_groups[g]
            bucket = [group["params"][i] for i in positions if group["params"][i].grad is not None]
            sharded = [p for p in bucket if is_row_sharded(p)]
            whole = [p for p in bucket if not is_row_sharded(p)]
            updates = [self._momentum_update(p, group) for p in whole]
            for p, update in zip(whole, self._orthogonalize_bucket(updates, group), strict=True):
                self._decay_and_step(p, group, update)
            if sharded:
                self._step_row_sharded(sharded, group)
        return loss

    def _momentum_update(self, p, group) -> torch.Tensor:
        """Advance the momentum buffer; return this rank's rows of the update to orthogonalise."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            # zeros_like keeps p's DTensor placements, so under FSDP2 the buffer is sharded too
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, grad = local_shard(state["momentum_buffer"]), local_shard(p.grad)
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _orthogonalize_bucket(self, updates, group) -> list[torch.Tensor]:
        """Newton–Schulz of same-shape updates as one batched run (docs/figures.md)."""
        if not updates:
            return []
        return list(self._orthogonalize(torch.stack(updates), group))

    def _orthogonalize(self, update, group) -> torch.Tensor:
        return newton_schulz(update, group["ns_steps"], self.newton_schulz_dtype(update.device))

    def newton_schulz_dtype(self, device: torch.device) -> torch.dtype:
        """The precision Newton–Schulz runs in on `device` (see ns_dtype above)."""
        return self.ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)

    @staticmethod
    def _decay_and_step(p, group, update):
        rows, cols = p.shape  # the global shape, also for a DTensor
        lr = group["lr"]
        weights = local_shard(p)
        weights.mul_(1 - lr * group["weight_decay"])
        weights.add_(update, alpha=-lr * lr_scale(rows, cols, group["adjust_lr"]))

    def _step_row_sharded(self, params, group):
        """Same-shape FSDP2 matrices: momentum and step on this rank's rows, as above."""
        updates = [self._momentum_update(p, group) for p in params]
        orthogonalized = self._orthogonalize_row_sharded(params, updates, group)
        for p, update in zip(params, orthogonalized, strict=True):
            self._decay_and_step(p, group, update)

    def _orthogonalize_row_sharded(self, params, updates, group) -> list[torch.Tensor]:
        """This rank's rows of each orthogonalised update (tests/dist_muon.py overrides it
        with the mistake the parity test must catch: orthogonalising the rows alone)."""
        return orthogonalize_on_owners(params, updates,
                                       lambda wholes: self._orthogonalize_bucket(wholes, group),
                                       self.newton_schulz_dtype(updates[0].device))


# ---------------------------------------------------------------------------------------
# Muon under FSDP2: the owner computes
# ---------------------------------------------------------------------------------------
# FSDP2 splits each matrix by rows (Shard(0)). Newton–Schulz of the local rows alone is a
# wrong update; on the DTensor it is right but runs collectives in every iteration. So each
# matrix has an owner rank that gathers its rows, orthogonalises it whole and sends the rows
# back, a shape's matrices together: two all-to-alls per shape, not two per matrix.
# Momentum stays a Shard(0) DTensor, so a checkpoint reloads on another number of ranks.


def is_row_sharded(p: torch.Tensor) -> bool:
    """True for an FSDP2 parameter, a DTensor split by rows over a 1-D mesh. Plain tensors
    (single process, DDP) and replicated DTensors hold the whole matrix on every rank."""
    if not isinstance(p, DTensor):
        return False
    if p.placements == (Shard(0),):
        return True
    if all(placement.is_replicate() for placement in p.placements):
        return False
    raise ValueError(f"Muon supports plain tensors, replicated DTensors and Shard(0) on a 1-D "
                     f"mesh (FSDP2); got placements {p.placements} for a {tuple(p.shape)} matrix")


def row_counts(rows: int, world: int) -> list[int]:
    """Rows on each rank under Shard(0), which splits like torch.chunk: ceil(rows/world) per
    rank and fewer (possibly none) on the last ranks, e.g. 13 rows on 3 ranks -> 5, 5, 3."""
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(world)]


def orthogonalize_on_owners(params, local_rows, orthogonalize,
                            dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's rows of each orthogonalised update, in `params` order: Newton–Schulz of n
    same-shape row-sharded updates on their owners, every rank calling it alike.

    local_rows: this rank's rows of each update; orthogonalize(wholes) runs Newton–Schulz in
    `dtype`, in which the pieces also travel (bf16 in a bf16 run, as modded-nanogpt and
    nanochat send): Newton–Schulz casts to it anyway, so no bit of the update changes.
    Matrix i belongs to rank i % W, in slot i // W; pieces are padded to ceil(rows / W) rows
    and ceil(n / W) slots, one shape for all. Each rank sends each owner its rows, owners
    orthogonalise in parallel, and each owner sends every rank its rows of the results."""
    mesh = params[0].device_mesh
    world, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    rows, cols = params[0].shape
    counts, slots = row_counts(rows, world), -(-len(params) // world)
    # outgoing[slot, owner]: this rank's rows of matrix slot·W + owner, padded
    outgoing = local_rows[0].new_zeros(slots, world, counts[0], cols, dtype=dtype)
    for i, piece in enumerate(local_rows):
        outgoing[i // world, i % world, :len(piece)] = piece
    incoming = all_to_all(outgoing, group)  # [slot, sender]: the sender's rows of my matrix
    mine = range(rank, len(params), world)
    wholes = [torch.cat([incoming[i // world, sender, :n] for sender, n in enumerate(counts)])
              for i in mine]
    results = outgoing.new_zeros(slots, world, counts[0], cols)  # [slot, receiver]
    for i, whole in zip(mine, orthogonalize(wholes), strict=True):
        for receiver, piece in enumerate(whole.split(counts)):
            results[i // world, receiver, :len(piece)] = piece
    returned = all_to_all(results, group)  # [slot, owner]: my rows of the owner's matrix
    return [returned[i // world, i % world, :len(piece)].to(piece.dtype)
            for i, piece in enumerate(local_rows)]


def all_to_all(pieces: torch.Tensor, group) -> torch.Tensor:
    """pieces (slots, W, ...) -> (slots, W, ...): piece [s, r] goes to rank r, and the result's
    [s, r] is the piece [s, this rank] of rank r, in one collective."""
    by_rank = pieces.transpose(0, 1).contiguous()  # (W, slots, ...): all_to_all splits dim 0
    received = torch.empty_like(by_rank)
    dist.all_to_all_single(received, by_rank, group=group)
    return received.transpose(0, 1)


# ---------------------------------------------------------------------------------------
# Parameter routing
# ---------------------------------------------------------------------------------------

def build_optimizers(model: torch.nn.Module, cfg, mixed_precision: str = "no") -> "Optimizers":
    """Muon for the hidden matrices, AdamW for the rest, each group recording its `peak_lr`.

    - Muon: the attention and MLP projections. Muon is for hidden layers that map vectors
      to vectors; the embedding is a lookup table with sparse row gradients (Jordan et al.).
    - AdamW "embedding": the tied embedding/head, decayed like every matrix (nanoGPT's rule:
      decay tensors with 2+ dims); as the head it sets the logit scale.
    - AdamW "gains": the 1-D norm weights, not decayed: decay would pull each gain towards 0.
    cfg.matrix_optimizer="adamw" gives the matrices a second AdamW ("adamw_matrices", the
    baseline of bench/recipe.py). A bf16 run (mixed_precision "bf16") orthogonalises in bf16.
    """
    embedding = model.embed.weight
    matrices, tables, gains = [], [], []
    for p in model.parameters():  # each tensor once: the tied head is not listed again
        if not p.requires_grad:
            continue
        if p.ndim == 2 and p is not embedding:
            matrices.append(p)
        else:
            (tables if p.ndim >= 2 else gains).append(p)
    if cfg.matrix_optimizer == "muon":
        name = "muon"
        matrix_optimizer = Muon(
            [dict(params=matrices, name="matrices", peak_lr=cfg.muon_peak_lr)],
            lr=cfg.muon_peak_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay,
            adjust_lr=cfg.muon_adjust_lr,
            ns_dtype=torch.bfloat16 if mixed_precision == "bf16" else None)
    else:
        name = "adamw_matrices"
        matrix_optimizer = torch.optim.AdamW(
            [dict(params=matrices, name="matrices", peak_lr=cfg.adamw_peak_lr)],
            lr=cfg.adamw_peak_lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    adamw_groups = [dict(params=tables, name="embedding", weight_decay=cfg.weight_decay),
                    dict(params=gains, name="gains", weight_decay=0.0)]
    adamw = torch.optim.AdamW([dict(g, peak_lr=cfg.adamw_peak_lr) for g in adamw_groups
                               if g["params"]], lr=cfg.adamw_peak_lr, betas=cfg.betas)
    return Optimizers({name: matrix_optimizer, "adamw": adamw})


class Optimizers:
    """The matrix optimizer and the AdamW for the rest, stepped as one; `named` in the order
    of logs and the banner. Only the public Optimizer API is used, so the optimizers that
    accelerate.prepare returns can stand in: Optimizers(dict(zip(names, prepared)))."""

    def __init__(self, named: dict[str, torch.optim.Optimizer]):
        self.named = named

    def set_lr(self, multiplier: float):
        """Every group's lr to its peak_lr × multiplier (the schedule's `lr_multiplier`)."""
        for optimizer in self.named.values():
            for group in optimizer.param_groups:
                group["lr"] = group["peak_lr"] * multiplier

    def step(self):
        for optimizer in self.named.values():
            optimizer.step()

    def zero_grad(self):
        for optimizer in self.named.values():
            optimizer.zero_grad(set_to_none=True)

    def lrs(self) -> dict[str, float]:
        """name -> the current lr of the optimizer's first group."""
        return {name: optimizer.param_groups[0]["lr"] for name, optimizer in self.named.items()}

    def summary(self) -> str:
        """One line, e.g. `muon matrices: 210 tensors 84,541,440 params wd 0.1 | adamw ...`.
        Call it before accelerate.prepare, whose wrapper class would become the label."""
        parts = []
        for optimizer in self.named.values():
            label = type(optimizer).__name__.lower()
            for group in optimizer.param_groups:
                numel = sum(p.numel() for p in group["params"])
                parts.append(f"{label} {group.get('name', 'group')}: {len(group['params'])} "
                             f"tensors {numel:,} params wd {group['weight_decay']:g}")
        return " | ".join(parts)


# ---------------------------------------------------------------------------------------
# Warmup-stable-decay schedule (arXiv 2404.06395)
# ---------------------------------------------------------------------------------------

# Progress p in [0, 1] through the decay leg -> the fraction of the way from final_frac to
# 1. "sqrt": Hägele et al. 2024 (arXiv 2405.18392) found it beats linear and cosine.
DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def schedule_summary(cfg) -> str:
    """E.g. `2,000 warmup / 32,332 stable / 3,815 decay (decay starts at step 34,332, sqrt)`."""
    phases = wsd_phases(cfg)
    return (f"{format_phases(phases)} (decay starts at step {phases.decay_start:,}, "
            f"{cfg.decay_shape})")


def lr_multiplier(step: int, cfg) -> float:
    """The lr at optimizer step `step` (0-indexed) as a fraction of the peak. Warmup and
    decay mirror each other, so no step trains at lr 0 (with final_frac 0): warmup gives
    1/W, 2/W, ..., 1.0 at step W − 1; the decay leg's D steps take p = 0, 1/D, ..., (D−1)/D,
    and final_frac is reached at step decay_start + D, after it."""
    phases = wsd_phases(cfg)
    if step < phases.warmup_steps:
        return (step + 1) / phases.warmup_steps
    if step < phases.decay_start:
        return 1.0
    # decay_steps 0: no leg, the multiplier drops straight to final_frac
    progress = min(1.0, (step - phases.decay_start) / max(phases.decay_steps, 1))
    return cfg.final_frac + (1.0 - cfg.final_frac) * DECAY_SHAPES[cfg.decay_shape](progress)
