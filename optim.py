"""Optimizers and the learning-rate schedule.

- `Muon` updates the hidden weight matrices: momentum, then an orthogonalised step
  (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/), with the weight decay
  and AdamW-matched step size of Moonlight (Liu et al. 2025, arXiv 2502.16982). Under FSDP2
  it orthogonalises each full matrix on one "owner" rank, never just the local shard.
- `build_optimizers` routes every parameter: hidden matrices to Muon, the tied
  embedding/head and the 1-D gains to AdamW; `Optimizers` holds the two, and the loop sets
  their lr, steps and zeroes them as one.
- `lr_multiplier` is the warmup-stable-decay (WSD) schedule (Hu et al. 2024, MiniCPM,
  arXiv 2404.06395) as a pure function of the step. The schedule's layout (`wsd_phases`)
  and its checks (`check_schedule`, which refuses a run that would stop mid-decay) are
  config.py's, run when the config is made.

Imports from stacklm: config (the schedule's layout). It takes a model and a config
object.
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
    """Approximately orthogonalise G = U S Vᵀ, returning ≈ U Vᵀ in G's dtype.

    G is one (A, B) matrix or a stack (N, A, B) of same-shape matrices, each orthogonalised
    on its own: a stack runs as batched matmuls, a few kernels instead of a few per matrix.

    Each iteration X ← aX + b(XXᵀ)X + c(XXᵀ)²X maps every singular value s of X to
    a·s + b·s³ + c·s⁵ and leaves U and V alone. The coefficients trade exactness for speed:
    after 5 steps the singular values oscillate in roughly [0.68, 1.15] instead of landing
    on 1, which Jordan et al. found trains as well as the exact U Vᵀ.
    """
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the short side: XXᵀ is then min(A, B)² instead of max(A, B)²
        X = X.mT
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1],
    # where the polynomial pushes it towards 1 instead of blowing up.
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    matmul_add = torch.baddbmm if X.ndim == 3 else torch.addmm  # β·M + α·(P @ Q), one call
    for _ in range(steps):
        gram = X @ X.mT
        polynomial = matmul_add(gram, gram, gram, beta=b, alpha=c)  # b·gram + c·gram²
        X = matmul_add(X, polynomial, X, beta=a)  # a·X + (b·gram + c·gram²)·X
    return (X.mT if tall else X).to(G.dtype)


# The step size of each lr_scale rule, relative to the lr, on a (rows x cols) matrix.
LR_SCALES = {
    "original": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
}


def lr_scale(rows: int, cols: int, adjust_lr: str) -> float:
    """How much Muon's step on a (rows x cols) matrix is scaled relative to the lr.

    An orthogonal update has every singular value 1, so its RMS entry is 1/sqrt(max(A, B)):
    the raw update of a wide MLP matrix is smaller than that of a square attention matrix.
    - "original" (Jordan et al. 2024): sqrt(max(1, A/B)), which makes the update's norm as a
      map from RMS-sized inputs to RMS-sized outputs equal 1 for tall matrices as well.
    - "match_rms_adamw" (Moonlight, arXiv 2502.16982, Sec. 2.2): 0.2·sqrt(max(A, B)), which
      gives every matrix an update RMS of 0.2, the typical RMS of an AdamW update.
    Any other name is a KeyError (config.py lists the valid ones for a run).
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
    barely touches still move. Weight decay comes from Moonlight (arXiv 2502.16982), which
    found Muon's weights and outputs otherwise grow too large over a long run.

    adjust_lr defaults to "match_rms_adamw": every matrix's update then has RMS 0.2·lr, the
    scale of an AdamW update, so the two optimizers' learning rates and weight decays are on
    one scale. That makes the two lrs comparable, not equal: TrainConfig.muon_peak_lr=6e-3
    is a starting point that no run here has tuned. "original" is Jordan et al.'s
    sqrt(max(1, A/B)); see `lr_scale`.

    ns_dtype is the Newton–Schulz precision; None picks bf16 on GPUs (as Jordan et al.:
    the iteration tolerates it and tensor cores make it fast) and float32 on CPUs, where
    bf16 pays only on those that compute it in hardware: build_optimizers passes bf16 for
    every bf16 run (faster than float32 on a CPU with bf16 arithmetic, docs/figures.md;
    emulated bf16 would be slower).

    Same-shape matrices are bucketed once, when the optimizer is built, and each bucket is
    orthogonalised as one batched Newton–Schulz. Under FSDP2 (Shard(0) DTensor parameters)
    each matrix is instead orthogonalised whole by one owner rank, the matrices of a shape
    sent there and back together (see "Muon under FSDP2" below). Gradients arrive already
    averaged by the wrapper (DDP/FSDP): Muon never reduces them again.
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
        # (group index, positions in group["params"]) per shape (Stack-100M's 210 matrices
        # have 4). Positions, not tensors: accelerate.prepare puts in the wrapped model's
        # parameters where its wrapping replaced them, and load_state_dict replaces the
        # group dicts.
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
            sharded = [p for p in bucket if is_row_sharded(p)]  # FSDP2's: see below
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
        """Newton–Schulz of same-shape updates as one batched run: a few large kernels in
        place of many small ones, faster on GPUs and CPUs alike (docs/figures.md)."""
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

    # FSDP2: the same update, but Newton–Schulz sees each matrix whole, on its owner rank.

    def _step_row_sharded(self, params, group):
        """params: same-shape row-sharded matrices with gradients. Momentum, decay and step
        work on this rank's rows; Newton–Schulz on each owner's whole matrices."""
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
# FSDP2 splits each matrix by rows over the ranks (Shard(0)). Newton–Schulz of the local
# rows alone is a different, wrong update (tests/dist_muon.py: its weights end tens of
# percent off), and Newton–Schulz on the DTensor is right but runs collectives inside every
# iteration, on every rank (torch.optim.Muon does that: correct, slow). So each matrix
# gets an owner rank: the others send it their rows, it orthogonalises the whole matrix,
# and sends each rank its rows back. The matrices of one shape travel together, in one
# all-to-all each way: a step makes two collectives per distinct shape (Stack-100M: 4
# shapes, 8 collectives), not two per matrix (420). Momentum stays shard-local as a
# Shard(0) DTensor, so a distributed checkpoint can reload it on another number of ranks.


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
    """Owner-computes Newton–Schulz of n same-shape row-sharded updates, in two all-to-alls;
    every rank calls it alike.

    params: the n (rows, cols) DTensor parameters; local_rows: this rank's rows of each
    update; orthogonalize(wholes) runs Newton–Schulz on a list of whole matrices; dtype is
    the one it runs in. The pieces travel in that dtype both ways (bf16 for a bf16 run: half
    the bytes of fp32, as modded-nanogpt and nanochat send): Newton–Schulz would cast the
    whole matrices to it first and its results come out in it, so casting the rows before
    they leave, and the results back to the update's dtype on arrival, changes no bit of
    the update. Matrix i
    belongs to rank i % W (the W ranks' shares differ by one matrix at most), in its slot
    i // W of k = ceil(n / W) slots. Every piece is padded to ceil(rows / W) rows and every
    rank to k slots, so that all pieces have one shape:
    1. each rank sends each owner its rows of the owner's matrices;
    2. each owner runs Newton–Schulz on its whole matrices, all ranks in parallel;
    3. each owner sends every rank its rows of the results.
    Returns this rank's rows of each orthogonalised update, in `params` order."""
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
              for i in mine]  # (rows, cols) each
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
    """Muon for the hidden matrices, AdamW for the rest, every group starting at its peak lr.

    - Muon: every 2-D parameter except the embedding, i.e. the attention and MLP
      projections. Muon is designed for hidden layers that map vectors to vectors; the
      embedding is a lookup table whose rows see sparse gradients (Jordan et al. 2024).
    - AdamW "embedding": model.embed.weight, which is also the tied output head, with weight
      decay: like every weight matrix it is a free scale that decay keeps in check (nanoGPT's
      rule: decay tensors with 2+ dims), and as the head it sets the logit scale.
    - AdamW "gains": the 1-D RMSNorm and QK-norm weights, without weight decay: decay would
      pull each gain towards 0, i.e. shrink the normalised activations it exists to rescale.

    Returns Optimizers({"muon": Muon, "adamw": AdamW}). With cfg.matrix_optimizer="adamw"
    the matrices go to a second AdamW at adamw_peak_lr instead (the all-AdamW baseline of
    bench/recipe.py): Optimizers({"adamw_matrices": AdamW, "adamw": AdamW}). Every group
    records its `peak_lr`; `Optimizers.set_lr` scales it by the schedule each step.
    mixed_precision is the run's (accelerate's "bf16" or "no"): a bf16 run orthogonalises
    in bf16 too, as bf16 is fast wherever the run computes in it; otherwise Muon's
    Newton–Schulz takes its own default (`Muon`'s ns_dtype).
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
    """The matrix optimizer and the AdamW for the rest, stepped as one.

    `named` maps a name to each optimizer, in the order of logs and the banner. Only the
    public Optimizer API is used (param_groups, step, zero_grad), so the optimizers that
    accelerate.prepare returns can stand in for the originals:
    Optimizers(dict(zip(names, prepared, strict=True))).
    """

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
        """One line, e.g. `muon matrices: 210 tensors 84,541,440 params wd 0.1 | adamw ...`:
        each group labelled by its optimizer's class. Call it before accelerate.prepare,
        whose wrapper class would become the label."""
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

# Each maps progress p in [0, 1] through the decay leg to a fraction of the way from
# final_frac up to 1. "sqrt" is the 1-sqrt cooldown of Hägele et al. 2024 (arXiv
# 2405.18392), which they found to beat linear and cosine cooldowns of the same length.
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
    """The learning rate at optimizer step `step` (0-indexed) as a fraction of the peak.

    Warmup and decay mirror each other, so no step trains at lr 0 (with final_frac 0):
    - warmup: (step + 1)/warmup_steps, i.e. 1/W, 2/W, ..., exactly 1.0 at step W − 1;
    - stable: exactly 1.0 up to decay_start − 1;
    - decay: progress p = (step − decay_start)/decay_steps, so the leg's D steps use
      p = 0, 1/D, ..., (D−1)/D, and final_frac is reached at step decay_start + D, after it.
    """
    phases = wsd_phases(cfg)
    if step < phases.warmup_steps:
        return (step + 1) / phases.warmup_steps
    if step < phases.decay_start:
        return 1.0
    # decay_steps 0: no leg, the multiplier drops straight to final_frac
    progress = min(1.0, (step - phases.decay_start) / max(phases.decay_steps, 1))
    return cfg.final_frac + (1.0 - cfg.final_frac) * DECAY_SHAPES[cfg.decay_shape](progress)
