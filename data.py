"""Data: the packed token batches the training loop reads, resumable to the window.

`PackedShardLoader(data_dir, split, seq_len, micro_batch_size, rank, world_size, seed)` is
an endless iterator; each next() is one rank's micro-batch, a dict of four (B, T) int64
tensors, B = micro_batch_size, T = seq_len:

    input_ids     stream[s : s + T] for a row whose window starts at token s
    targets       stream[s + 1 : s + T + 1], the next token at every position
    position_ids  each token's position inside its document (RoPE sees these)
    seq_ids       which document of the row each token belongs to: 0, 1, 2, ...

Document masking. A row packs documents end to end; attention stays within equal seq_ids
and positions restart in each, so a document reads as if it were alone in the row.

The token stream. A split is its shards concatenated. EOS is written *before* every
document, `[EOS d1 EOS d2 ...]`, so it doubles as the next document's beginning-of-sequence
token and belongs to it (seq_ids increase there, position 0). Hence no target is ignored:
a document's last token predicts EOS (where documents end), and EOS, with only itself as
context, the next document's first token (how documents open).

Windows. Window i is tokens [i*T, i*T + T + 1): inputs the first T, targets the last T, so
each token is a target once per epoch. A row starting mid-document has position 0 there.

Order and ranks. Epoch e visits the windows in a permutation seeded by (seed, e, the
data's fingerprint). One cursor counts the windows all ranks consumed; a global micro-batch
is the next micro_batch_size*world_size windows, rank r's the r-th block. So the batches
depend on the seed alone, not the number of ranks, and a saved cursor resumes exactly under
any world size. The val split is read in stream order, unshuffled.

Mixtures. Training reads a `MixtureLoader`: stages of prepared directories by weight,
interleaved so that every stretch holds each source's share, with the same one cursor.

Exact resume. state_dict() is that cursor plus what it depends on (seq_len, seed, the
data's identity, each source's position); load_state_dict() refuses other data's state.

On disk. `python prepare.py` writes tokenizer.json, manifest.json and {train,val}_NNNNN.bin
shards of token ids once, offline; plumbing/shards.py checks each shard against the manifest
when first opened, so a flipped byte or a foreign shard fails at start-up.

Imports from stacklm: shards (a prepared folder's manifest and its checks).
"""

import bisect
import hashlib
import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

from plumbing.shards import check_shards, fingerprint, load_manifest, shard_paths, tokenizer_path

# Written before every document of a token stream (see "The token stream" above).
EOS_TOKEN = "<|endoftext|>"
LAYOUT_BLOCK = 1 << 16  # mixture positions laid out at once (1 MB of layout)


# ---------------------------------------------------------------------------------------
# The loader
# ---------------------------------------------------------------------------------------

class PackedShardLoader:
    """An endless iterator of packed (B, T) batches for one rank; see the module docstring
    for the window order. state_dict() is the global cursor: it resumes exactly, under any
    world_size or micro_batch_size."""

    def __init__(self, data_dir, split, seq_len, micro_batch_size, rank=0, world_size=1,
                 seed=1337):
        if seq_len < 1 or micro_batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"PackedShardLoader: need seq_len >= 1, micro_batch_size >= 1 and "
                             f"0 <= rank < world_size; got {seq_len}, {micro_batch_size}, "
                             f"rank {rank} of {world_size}")
        self.data_dir, self.split, self.seq_len, self.seed = str(data_dir), split, seq_len, seed
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.manifest = load_manifest(data_dir)
        self.eos_id = self.manifest["eos_id"]
        shards = shard_paths(data_dir, self.manifest, split)
        check_shards(data_dir, self.manifest, shards)  # once per process: see check_shards
        # plain ndarray views of the maps: slicing the np.memmap subclass costs µs per row
        self.shards = [np.memmap(path, dtype=self.manifest["dtype"], mode="r").view(np.ndarray)
                       for path, _ in shards]
        sizes = [entry["tokens"] for _, entry in shards]
        self.shard_starts = [sum(sizes[:i]) for i in range(len(sizes))]  # stream offsets
        self.fingerprint = fingerprint(self.manifest)
        self.fingerprint_words = [int(self.fingerprint[i:i + 8], 16) for i in range(0, 32, 8)]
        # Identifies the data in state_dict: a cursor means nothing on other tokens.
        self.data_sha256 = hashlib.sha256("".join(e["sha256"] for _, e in shards).encode()) \
            .hexdigest()
        self.windows_per_epoch = windows_per_epoch(self.manifest, split, seq_len)
        if self.windows_per_epoch < 1:
            fix = ("prepare it again with a larger --val_fraction (e.g. `python prepare.py "
                   "--source YOUR_CORPUS --val_fraction 0.05 --data_dir NEW_DIR`)" if split == "val"
                   else "prepare a larger corpus")
            raise ValueError(f"split {split!r} of {data_dir} has {sum(sizes):,} tokens, too "
                             f"few for one window of seq_len={seq_len} (it needs seq_len+1); "
                             f"{fix}, or lower --seq_len")
        self.tokens_per_epoch = self.windows_per_epoch * seq_len
        self.shuffle = split != "val"  # evaluation must see the same tokens every time
        self.cursor = 0  # windows consumed by all ranks together
        self.new_epochs = []  # epochs begun since the log last asked (take_new_epochs)
        self._permutation_epoch, self._permutation = None, None

    @property
    def epoch(self) -> int:
        """The epoch of the next window of the global stream."""
        return self.cursor // self.windows_per_epoch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch_windows = self.micro_batch_size * self.world_size
        mine = self.cursor + self.rank * self.micro_batch_size  # this rank's block
        windows = self.window_indices(np.arange(mine, mine + self.micro_batch_size))  # (B,)
        self.note_new_epochs(self.cursor, self.cursor + batch_windows)
        self.cursor += batch_windows
        return self.batch(windows)

    def window_indices(self, global_positions: np.ndarray) -> np.ndarray:
        """Global stream position k -> window index: perm_{k // N}[k % N]."""
        n = self.windows_per_epoch
        if not self.shuffle:
            return global_positions % n
        windows = np.empty_like(global_positions)
        epochs = global_positions // n
        for epoch in np.unique(epochs):  # usually one; several if a batch outgrows an epoch
            at = epochs == epoch
            windows[at] = self.permutation(int(epoch))[global_positions[at] % n]
        return windows

    def permutation(self, epoch: int) -> np.ndarray:
        """A fresh order each epoch, seeded by (seed, epoch, the data's own fingerprint): not
        by the source's place in a mixture, so listing sources in another order or adding
        one changes no source's order; and two sources never share a shuffle."""
        if epoch != self._permutation_epoch:
            rng = np.random.default_rng([self.seed, epoch, *self.fingerprint_words])
            self._permutation_epoch = epoch
            self._permutation = rng.permutation(self.windows_per_epoch)
        return self._permutation

    def note_new_epochs(self, begin: int, end: int):
        """Remember each epoch whose first window lies in global positions [begin, end), for
        the log to print (take_new_epochs); val is exempt, as evaluation rereads it by design."""
        if self.shuffle:
            n = self.windows_per_epoch
            self.new_epochs += range(max(1, -(-begin // n)), (end - 1) // n + 1)

    def take_new_epochs(self) -> list[int]:
        """The epochs begun since the last call: a small corpus can pass several between two
        log lines, and the log prints them as one."""
        epochs, self.new_epochs = self.new_epochs, []
        return epochs

    def read(self, start: int, out: np.ndarray):
        """Copy stream tokens [start, start + len(out)) into out, across shard boundaries."""
        shard = bisect.bisect_right(self.shard_starts, start) - 1
        filled = 0
        while filled < len(out):
            offset = start + filled - self.shard_starts[shard]
            piece = self.shards[shard][offset:offset + len(out) - filled]
            out[filled:filled + len(piece)] = piece
            filled += len(piece)
            shard += 1

    def read_rows(self, windows: np.ndarray, out: np.ndarray, rows):
        """Fill out[rows[k]] (of out's (B, T+1)) with window windows[k]'s T+1 tokens."""
        for row, window in zip(rows, windows, strict=True):
            self.read(int(window) * self.seq_len, out[row])

    def batch(self, windows: np.ndarray) -> dict[str, torch.Tensor]:
        tokens = np.empty((len(windows), self.seq_len + 1), dtype=self.shards[0].dtype)
        self.read_rows(windows, tokens, range(len(windows)))  # (B, T+1)
        return pack(tokens, self.eos_id)

    def state_dict(self) -> dict:
        return {"split": self.split, "cursor": self.cursor, "seed": self.seed,
                "seq_len": self.seq_len, "windows_per_epoch": self.windows_per_epoch,
                "data_sha256": self.data_sha256, "epoch": self.epoch}

    def load_state_dict(self, state: dict):
        """Resume at a saved cursor. The stream is only the same if the data, split, seq_len
        and seed are, so any difference is an error rather than silently other windows."""
        mine = self.state_dict()
        for key in ("split", "seq_len", "seed", "data_sha256"):
            if state[key] != mine[key]:
                raise ValueError(f"loader state was saved with {key}={state[key]!r}, this loader "
                                 f"has {mine[key]!r}; resume with the same data_dir, split, "
                                 f"seq_len and seed, or start the data stream afresh")
        self.cursor = int(state["cursor"])


def pack(tokens: np.ndarray, eos_id: int) -> dict[str, torch.Tensor]:
    """(B, T+1) token rows -> the four (B, T) int64 tensors of a batch."""
    inputs = tokens[:, :-1]  # (B, T)
    starts = inputs == eos_id  # an EOS opens the document that follows it
    starts[:, 0] = False  # the row's first segment is document 0, whatever opens it
    seq_ids = np.cumsum(starts, axis=1, dtype=np.int64)  # (B, T)
    # position = t - (latest segment start at or before t), computed in place: fresh
    # (B, T) int64 arrays cost more in page faults than the arithmetic does
    positions = np.arange(inputs.shape[1])  # (T,)
    position_ids = np.multiply(starts, positions, dtype=np.int64)  # start t, else 0
    np.maximum.accumulate(position_ids, axis=1, out=position_ids)
    np.subtract(positions, position_ids, out=position_ids)  # (B, T)
    return {"input_ids": torch.from_numpy(inputs.astype(np.int64)),
            "targets": torch.from_numpy(tokens[:, 1:].astype(np.int64)),
            "position_ids": torch.from_numpy(position_ids),
            "seq_ids": torch.from_numpy(seq_ids)}


# ---------------------------------------------------------------------------------------
# Mixtures: several prepared directories by weight, in stages
# ---------------------------------------------------------------------------------------

class Stage(NamedTuple):
    """From optimizer step `first_step` on, the run reads `sources`: (data_dir, weight)
    pairs; a weight is a share of the training windows, whatever the source's size."""
    first_step: int
    sources: tuple[tuple[str, float], ...]


def integer_weights(weights) -> list[int]:
    """Weights as the smallest integers in the same ratio (7, 2, 1 stay; 0.6, 0.3, 0.1 ->
    6, 3, 1), so that interleave compares them exactly."""
    fractions = [Fraction(w).limit_denominator(1000) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    divisor = math.gcd(*ints)
    return [i // divisor for i in ints]


def interleave(weights: list[int], first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, j) for each position [first, first + count) of a mixture: which source
    fills it, and with which of that source's windows (its j-th in this stage).

    Source i's j-th window has the key (j + 1/2) / w_i, and the stream takes the windows in
    key order (ties: the lower i first), so every stretch holds each source's share w_i /
    sum(w) to within a window or two. A window's position is the number of keys before its
    own, counted in integers, so any stretch is computed alone, in O(count · sources)."""
    total, n = sum(weights), len(weights)
    source, index = np.empty(count, np.int8), np.empty(count, np.int64)
    for i, w in enumerate(weights):
        # pos(i, j) = (j + 1/2) · total / w - 1/2, within n - 1: these j cover the stretch
        j = np.arange(max(0, first * w // total - n - 1), (first + count) * w // total + n + 2)
        odd, pos = 2 * j + 1, j - first  # pos: j, plus the other sources' keys before j's
        for other, v in enumerate(weights):
            if other != i:  # count odd o >= 1 with o / v before odd / w, in place
                before = odd * v
                if other > i:  # a tie goes to the lower source: strictly before
                    before -= 1
                before //= w
                before += 1
                before >>= 1
                pos += before
        here = (pos >= 0) & (pos < count)
        source[pos[here]], index[pos[here]] = i, j[here]
    return source, index


class MixtureLoader:
    """The training stream: stages of weighted sources, each a train split in its own seeded
    order, read through `interleave` with one cursor as for one source. The stage follows
    the optimizer step (set_step), and a source in two stages continues where it stopped."""

    def __init__(self, stages: list[Stage], seq_len, micro_batch_size, rank=0, world_size=1,
                 seed=1337):
        self.stages, self.seq_len, self.seed = stages, seq_len, seed
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        dirs = list(dict.fromkeys(d for stage in stages for d, _ in stage.sources))
        self.sources = {d: PackedShardLoader(d, "train", seq_len, micro_batch_size, rank,
                                             world_size, seed) for d in dirs}
        self.eos_id = self.sources[dirs[0]].eos_id  # one tokenizer: preflight checks it
        self.dtype = np.result_type(*(s.shards[0].dtype for s in self.sources.values()))
        self.consumed = dict.fromkeys(dirs, 0)  # windows each source has given, all stages
        self.stage, self.cursor, self.offsets = None, 0, {}
        self.set_step(0)

    def set_step(self, step: int):
        """Enter the stage that covers optimizer step `step`. Its sources continue from what
        they gave so far (self.consumed); its cursor starts at 0."""
        stage = max((s for s in self.stages if s.first_step <= step), key=lambda s: s.first_step)
        if stage != self.stage:
            self.stage, self.cursor, self.offsets = stage, 0, dict(self.consumed)
            self.weights = integer_weights([w for _, w in stage.sources])
            self._layout_start, self._layout = 0, (np.empty(0), np.empty(0))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        B, batch = self.micro_batch_size, self.micro_batch_size * self.world_size
        source, index = self.layout(self.cursor, batch)  # (B·world,) each
        mine = slice(self.rank * B, self.rank * B + B)
        tokens = np.empty((B, self.seq_len + 1), dtype=self.dtype)  # (B, T+1)
        given = np.bincount(source, minlength=len(self.stage.sources))  # all ranks' rows
        for i, (d, _) in enumerate(self.stage.sources):
            loader, rows = self.sources[d], np.flatnonzero(source[mine] == i)
            positions = self.offsets[d] + index[mine][rows]  # the source's own stream
            loader.read_rows(loader.window_indices(positions), tokens, rows)
            loader.note_new_epochs(self.consumed[d], self.consumed[d] + int(given[i]))
            self.consumed[d] += int(given[i])
        self.cursor += batch
        return pack(tokens, self.eos_id)

    def layout(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """interleave's (source, j) for stage positions [first, first + count), computed
        LAYOUT_BLOCK positions at a time: one numpy call per block, not per micro-batch."""
        start = self._layout_start
        if not (start <= first and first + count <= start + len(self._layout[0])):
            start, self._layout_start = first, first
            self._layout = interleave(self.weights, first, max(count, LAYOUT_BLOCK))
        return self._layout[0][first - start:first - start + count], \
            self._layout[1][first - start:first - start + count]

    def take_new_epochs(self) -> dict[str, list[int]]:
        """Per source, the epochs begun since the last call (for the log)."""
        return {d: loader.take_new_epochs() for d, loader in self.sources.items()}

    def tokens_read(self) -> dict[str, int]:
        return {d: n * self.seq_len for d, n in self.consumed.items()}

    def state_dict(self) -> dict:
        return {"seq_len": self.seq_len, "seed": self.seed, "stage_start": self.stage.first_step,
                "cursor": self.cursor, "offsets": self.offsets, "consumed": self.consumed,
                "fingerprints": {d: s.fingerprint for d, s in self.sources.items()}}

    def load_state_dict(self, state: dict):
        """Resume at a saved cursor. The stream is only the same if seq_len, seed and the
        contents of every source it read are: any difference is an error."""
        for key in ("seq_len", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(f"loader state was saved with {key}={state[key]!r}, this run "
                                 f"has {getattr(self, key)!r}; resume with the same {key}")
        for d, saved in state["fingerprints"].items():
            if d in self.sources and saved != self.sources[d].fingerprint:
                raise ValueError(f"source {d} changed since the checkpoint was written (its "
                                 f"shards or tokenizer differ); restore it, or start afresh")
        self.consumed = {d: state["consumed"].get(d, 0) for d in self.sources}
        self.stage = None
        self.set_step(state["stage_start"])
        self.cursor = int(state["cursor"])
        self.offsets = {d: state["offsets"].get(d, self.consumed[d]) for d in self.sources}


# ---------------------------------------------------------------------------------------
# What a run reads of a prepared directory's manifest
# ---------------------------------------------------------------------------------------

def has_val(manifest: dict) -> bool:
    """False for a directory prepared with --val_fraction 0, which has no val split."""
    return manifest["splits"]["val"]["tokens"] > 0


def val_shares(stages: list[Stage], manifests: dict[str, dict]) -> dict[str, float]:
    """The sources evaluated (those with a val split) and their weights in val_loss: the
    first stage's shares renormalised over them (a later stage's own source counts 0), or,
    where the first stage has no val split, the first stage's that has one."""
    evaluated = [d for d in manifests if has_val(manifests[d])]
    if not evaluated:
        raise ValueError(f"no source of this run has a val split ({', '.join(manifests)}), "
                         f"so it cannot be evaluated; prepare one with --val_fraction above 0")
    first = next(stage.sources for stage in stages
                 if any(d in evaluated for d, _ in stage.sources))
    kept = {d: w for d, w in first if d in evaluated}
    total = sum(kept.values()) if len(kept) < len(first) else 1.0  # shares sum to 1 already
    return {d: kept.get(d, 0.0) / total for d in evaluated}


def windows_per_epoch(manifest: dict, split: str, seq_len: int) -> int:
    """Windows of seq_len in a split: window i needs tokens up to i*T + T, the last of which
    is only ever a target."""
    return max(0, manifest["splits"][split]["tokens"] - 1) // seq_len


def token_bytes(data_dir) -> torch.Tensor:
    """(vocab_size,) int64: the UTF-8 bytes each id stands for, 0 for special tokens, so
    bits per byte = sum(loss) / (ln 2 * sum(token_bytes[targets]))."""
    tokenizer = Tokenizer.from_file(tokenizer_path(data_dir))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    sizes = [0] * load_manifest(data_dir)["vocab_size"]
    for token, i in tokenizer.get_vocab().items():
        # byte-level BPE spells every byte as one symbol, so symbols = bytes
        sizes[i] = 0 if i in special else len(token)
    return torch.tensor(sizes, dtype=torch.int64)
