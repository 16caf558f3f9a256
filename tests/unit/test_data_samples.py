"""gpt3 samples: shifted/masked labels, seeded shuffle, consumed-offset addressing, DP slices, validation set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scaletrain.data.indexed import DataError, IndexedDataset, write_indexed
from scaletrain.data.samples import TrainSamples, ValidSamples, measure_loader_tokens_per_s
from scaletrain.model.loss import IGNORE_INDEX

S = 8


@pytest.fixture
def stream():
    # Token t at position t (+1 so no real token equals the pad id 0); 403 = 50 full samples + 3 leftover.
    return (np.arange(403) + 1).astype(np.uint16)


@pytest.fixture
def dataset(tmp_path, stream):
    # Uneven documents: samples must cross document boundaries exactly as the flat stream does.
    cuts = [0, 5, 100, 101, 300, 403]
    write_indexed(tmp_path / "t", [stream[a:b] for a, b in zip(cuts, cuts[1:])], dtype=np.uint16)
    return IndexedDataset(tmp_path / "t")


def test_samples_are_stream_slices_with_shifted_masked_labels(dataset, stream):
    ts = TrainSamples(dataset, S, seed=1)
    assert ts.num_samples == 403 // S
    ids = ts.sample_ids(0, 12)
    x, y = ts.batch(0, 12)
    assert x.dtype == torch.long and y.dtype == torch.long and x.shape == (12, S) == y.shape
    for row, k in enumerate(ids):
        assert x[row].tolist() == stream[k * S : (k + 1) * S].tolist()
        assert y[row, :-1].tolist() == stream[k * S + 1 : (k + 1) * S].tolist()
        assert y[row, -1].item() == IGNORE_INDEX


def test_shuffle_is_seeded_and_per_epoch(dataset):
    n = 403 // S
    a, b, c = TrainSamples(dataset, S, 7), TrainSamples(dataset, S, 7), TrainSamples(dataset, S, 8)
    assert np.array_equal(a.sample_ids(0, 3 * n), b.sample_ids(0, 3 * n))
    assert not np.array_equal(a.sample_ids(0, n), c.sample_ids(0, n))
    e0, e1 = a.sample_ids(0, n), a.sample_ids(n, n)
    assert sorted(e0.tolist()) == list(range(n)) == sorted(e1.tolist())  # each epoch is a permutation
    assert not np.array_equal(e0, e1)  # reshuffled per epoch
    assert not np.array_equal(e0, np.arange(n))  # actually shuffled


def test_consumed_offset_addressing(dataset):
    ts = TrainSamples(dataset, S, seed=3)
    n = ts.num_samples
    full_x, full_y = ts.batch(n - 5, 10)  # crosses the epoch boundary
    part_x, part_y = ts.batch(n - 2, 7)
    assert torch.equal(full_x[3:], part_x) and torch.equal(full_y[3:], part_y)
    # A fresh instance (a resumed run) yields the same samples at the same offset.
    fresh = TrainSamples(dataset, S, seed=3)
    assert torch.equal(fresh.batch(n - 2, 7)[0], part_x)
    assert ts.epoch_of(n - 1) == 0 and ts.epoch_of(n) == 1


@pytest.mark.parametrize("dp, micro", [(1, 12), (1, 3), (2, 6), (2, 2), (3, 4), (4, 1), (12, 1)])
def test_rank_slices_concatenate_to_global_batch(dataset, dp, micro):
    ts = TrainSamples(dataset, S, seed=5)
    G, consumed = 12, 45  # the global batch crosses into epoch 1
    want_x, want_y = ts.batch(consumed, G)
    xs, ys = [], []
    for r in range(dp):
        for m in range(G // dp // micro):
            x, y = ts.rank_batch(consumed, G, r, dp, micro, m)
            assert x.shape == (micro, S)
            xs.append(x)
            ys.append(y)
    assert torch.equal(torch.cat(xs), want_x) and torch.equal(torch.cat(ys), want_y)


def test_rank_batch_rejects_bad_layouts(dataset):
    ts = TrainSamples(dataset, S, seed=5)
    with pytest.raises(ValueError):
        ts.rank_batch(0, 10, 0, 3, 1, 0)  # G not divisible by dp
    with pytest.raises(ValueError):
        ts.rank_batch(0, 12, 0, 2, 4, 0)  # micro does not divide G/dp
    with pytest.raises(ValueError):
        ts.rank_batch(0, 12, 2, 2, 2, 0)  # rank out of range
    with pytest.raises(ValueError):
        ts.rank_batch(0, 12, 0, 2, 2, 3)  # micro index out of range


def test_too_short_dataset(tmp_path):
    write_indexed(tmp_path / "s", [np.arange(1, 8)], dtype=np.uint16)
    with pytest.raises(DataError, match=r"s\.bin: 7 tokens"):
        TrainSamples(IndexedDataset(tmp_path / "s"), 8, seed=0)
    assert TrainSamples(np.arange(1, 9), 8, seed=0).num_samples == 1


def _check_valid(tokens, seq_len, micro):
    vs = ValidSamples(tokens, seq_len)
    n = len(tokens)
    xs, ys = zip(*vs.batches(micro))
    x, y = torch.cat(xs), torch.cat(ys)
    assert x.shape == (vs.num_sequences, seq_len) == (-(-n // seq_len), seq_len)
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    assert flat_x[:n].tolist() == tokens.tolist()  # every token an input exactly once, in order
    assert (flat_x[n:] == 0).all() and (flat_y[n - 1 :] == IGNORE_INDEX).all()  # padding masked
    assert (y[:, -1] == IGNORE_INDEX).all()  # last position of every sequence has no label
    mask = flat_y != IGNORE_INDEX
    assert int(mask.sum()) == vs.num_label_tokens
    pos = torch.nonzero(mask).squeeze(1)
    assert torch.equal(flat_y[pos], flat_x[pos + 1])  # label = next token of the same sequence
    return vs


def test_valid_partial_last_sequence():
    tokens = (np.arange(403) + 1).astype(np.uint16)
    vs = _check_valid(tokens, S, micro=4)
    assert vs.num_sequences == 51
    assert vs.num_label_tokens == 50 * (S - 1) + 2
    x, y = vs.batch(50, 1)
    assert x[0].tolist() == [401, 402, 403, 0, 0, 0, 0, 0]
    assert y[0].tolist() == [402, 403] + [IGNORE_INDEX] * 6


def test_valid_exact_multiple_and_dp_shards():
    tokens = (np.arange(400) + 1).astype(np.uint16)
    vs = _check_valid(tokens, S, micro=3)
    assert vs.num_label_tokens == 50 * (S - 1)
    seen, labels = [], 0
    for r in range(3):
        for x, y in vs.batches(4, dp_rank=r, dp_size=3):
            seen.append(x)
            labels += int((y != IGNORE_INDEX).sum())
        assert vs.num_batches(4, r, 3) == -(-(vs.rank_range(r, 3)[1] - vs.rank_range(r, 3)[0]) // 4)
    assert torch.cat(seen).reshape(-1).tolist() == tokens.tolist()
    assert labels == vs.num_label_tokens


def test_valid_from_indexed_dataset(dataset, stream):
    vs = ValidSamples(dataset, 16)
    x, _ = next(vs.batches(100))
    assert x.reshape(-1)[:403].tolist() == stream.tolist()
    with pytest.raises(DataError):
        ValidSamples(np.array([5], dtype=np.uint16), 16)  # one token: nothing to predict


def test_loader_speed_helper(dataset):
    tps = measure_loader_tokens_per_s(TrainSamples(dataset, S, 0), batch=4, seconds=0.05)
    assert tps > 0
