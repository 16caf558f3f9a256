"""MLPerf gpt3 sample construction: token stream -> fixed-length samples -> seeded shuffle.

Training: the dataset's documents, concatenated in stored order without an end token (the .bin is
exactly that), are cut into seq_len-token samples; sample k = tokens[k*S:(k+1)*S]. Labels are the
inputs shifted left by one and the last position (whose next token belongs to another sample) is
masked. A trailing N mod S tokens are never trained on. Sample order is a fresh permutation per
epoch drawn from (seed, epoch), so a run is addressable by "samples consumed so far" alone.

Validation: the whole set, cut the same way, the last partial sequence kept and padded with masked
positions, so every token is an input exactly once and the token-weighted mean CE covers it all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch

from scaletrain.model.loss import IGNORE_INDEX  # the loss's convention; model/loss.py imports nothing from data/

from .indexed import DataError, IndexedDataset

PAD_TOKEN = 0


def _tokens_and_name(dataset) -> tuple[np.ndarray, str]:
    if isinstance(dataset, IndexedDataset):
        return dataset.tokens, str(dataset.bin_file)
    arr = np.asarray(dataset)
    if arr.ndim != 1:
        raise ValueError(f"expected an IndexedDataset or a 1-D token array, got shape {arr.shape}")
    return arr, "<token array>"


def _to_tensors(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    # rows: [B, S] in the stored dtype. One int64 copy (a plain ndarray, not a memmap subclass),
    # then labels from a shifted slice of it.
    inputs = torch.from_numpy(rows.astype(np.int64).view(np.ndarray))
    labels = torch.empty_like(inputs)
    labels[:, :-1] = inputs[:, 1:]
    labels[:, -1] = IGNORE_INDEX
    return inputs, labels


class TrainSamples:
    """Shuffled fixed-length training samples over one dataset, addressed by global position.

    Global position g (the g-th sample the run consumes, counting from 0) is sample
    perm_e[g mod n] of epoch e = g // n, with perm_e a permutation drawn from PCG64((seed, e)).
    """

    def __init__(self, dataset, seq_len: int, seed: int) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len}: must be >= 2 (one input and one label)")
        if seed < 0:
            raise ValueError(f"seed={seed}: must be >= 0")
        tokens, self.name = _tokens_and_name(dataset)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.num_samples = int(tokens.shape[0]) // self.seq_len
        if self.num_samples < 1:
            raise DataError(f"{self.name}: {tokens.shape[0]} tokens, fewer than one sample of seq_len {seq_len}")
        # A [n, S] view of the memmap (no copy): a batch is then one row gather.
        self._rows = tokens[: self.num_samples * self.seq_len].reshape(self.num_samples, self.seq_len)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens covered by one epoch of samples (inputs, including each sample's unlabelled last one)."""
        return self.num_samples * self.seq_len

    def epoch_of(self, position: int) -> int:
        """Epoch that global position `position` falls in."""
        return int(position) // self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """Sample order of one epoch (cached; the two most recent epochs are kept)."""
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, int(epoch)]))
            perm = rng.permutation(self.num_samples).astype(np.int64)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """Sample indices (into the unshuffled sample list) of global positions start .. start+count-1."""
        if start < 0 or count < 0:
            raise ValueError(f"start={start}, count={count}: must be >= 0")
        pos = np.arange(start, start + count, dtype=np.int64)
        epochs = pos // self.num_samples
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):  # one or two epochs per batch in practice
            sel = epochs == e
            out[sel] = self.permutation(int(e))[pos[sel] % self.num_samples]
        return out

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), LongTensors of shape [count, seq_len], for global positions [start, start+count)."""
        return _to_tensors(self._rows[self.sample_ids(start, count)])

    def rank_batch(
        self, consumed: int, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int, micro_index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `micro_index` of data-parallel rank `dp_rank` in the global batch starting at `consumed`.

        Rank r owns rows [r*G/dp, (r+1)*G/dp) of the global batch and walks them in micro-batches,
        so the global batch is the same set of samples in the same order for any (dp, micro) layout.
        """
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}, dp_size={dp_size}: need 0 <= dp_rank < dp_size")
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch}: must be a multiple of dp_size={dp_size}")
        per_rank = global_batch // dp_size
        if micro_batch < 1 or per_rank % micro_batch:
            raise ValueError(f"micro_batch={micro_batch}: must divide the per-rank batch {per_rank}")
        if not 0 <= micro_index < per_rank // micro_batch:
            raise ValueError(f"micro_index={micro_index}: must be in [0, {per_rank // micro_batch})")
        return self.batch(consumed + dp_rank * per_rank + micro_index * micro_batch, micro_batch)


class ValidSamples:
    """The whole validation set as seq_len sequences, the last one padded; see the module docstring."""

    def __init__(self, dataset, seq_len: int) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len}: must be >= 2 (one input and one label)")
        tokens, self.name = _tokens_and_name(dataset)
        self._tokens = tokens
        self.seq_len = int(seq_len)
        self.num_tokens = int(tokens.shape[0])
        self.num_sequences = -(-self.num_tokens // self.seq_len)
        self._full = self.num_tokens // self.seq_len
        tail = self.num_tokens - self._full * self.seq_len
        # Each sequence's last real position has no label inside the sequence.
        self.num_label_tokens = self._full * (self.seq_len - 1) + max(tail - 1, 0)
        if self.num_label_tokens < 1:
            raise DataError(f"{self.name}: {self.num_tokens} tokens leave no label to evaluate at seq_len {seq_len}")

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of sequences [start, start+count) (clipped to the set), padding masked."""
        S = self.seq_len
        stop = min(start + count, self.num_sequences)
        if start < 0 or start >= stop:
            raise ValueError(f"start={start}, count={count}: outside [0, {self.num_sequences})")
        lo, hi = start * S, min(stop * S, self.num_tokens)
        n = stop - start
        flat = np.full(n * S, PAD_TOKEN, dtype=np.int64)
        flat[: hi - lo] = self._tokens[lo:hi]
        inputs, labels = _to_tensors(flat.reshape(n, S))
        if hi - lo < n * S:
            # The partial sequence: its last real position and the padding after it carry no label.
            labels.view(-1)[hi - lo - 1 :] = IGNORE_INDEX
        return inputs, labels

    def batches(
        self, micro_batch: int, dp_rank: int = 0, dp_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, labels) over the whole set in order, micro_batch sequences at a time (the last may be smaller).

        With dp_size > 1 each rank gets a contiguous share of the sequences (shares differ by at most
        one); sum CE and label counts across ranks, then divide by num_label_tokens.
        """
        if micro_batch < 1:
            raise ValueError(f"micro_batch={micro_batch}: must be >= 1")
        lo, hi = self.rank_range(dp_rank, dp_size)
        for s in range(lo, hi, micro_batch):
            yield self.batch(s, min(micro_batch, hi - s))

    def rank_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """Sequences [lo, hi) that data-parallel rank `dp_rank` evaluates."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}, dp_size={dp_size}: need 0 <= dp_rank < dp_size")
        n = self.num_sequences
        return dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size

    def num_batches(self, micro_batch: int, dp_rank: int = 0, dp_size: int = 1) -> int:
        """How many batches batches() yields for this rank."""
        lo, hi = self.rank_range(dp_rank, dp_size)
        return -(-(hi - lo) // micro_batch)


def measure_loader_tokens_per_s(train_samples: TrainSamples, batch: int, seconds: float = 2.0, seed: int = 0) -> float:
    """Input tokens/s that TrainSamples.batch() delivers alone, fetching `batch` samples at random global positions."""
    rng = np.random.default_rng(seed)
    # Positions within one epoch: a run reads epochs in order, so a permutation is built once per epoch.
    span = train_samples.num_samples
    train_samples.batch(0, batch)  # warm the page cache and the first permutation
    n, t0 = 0, time.perf_counter()
    deadline = t0 + seconds
    while True:
        starts = rng.integers(0, span, size=64)
        for s in starts:
            train_samples.batch(int(s), batch)
        n += starts.size
        now = time.perf_counter()
        if now >= deadline:
            break
    return n * batch * train_samples.seq_len / (now - t0)
