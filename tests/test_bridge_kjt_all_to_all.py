"""The bridge to TorchRec's KJT all-to-all internals (dynemb/bridges/kjt_all_to_all.py), on
2 spawned CPU ranks: the head rows reach every peer's check, and the KJTs exchanged are
exactly those of TorchRec's own ``KJTAllToAll``. Fails if the pinned TorchRec moves the
internals the bridge relies on."""
import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.bridges.kjt_all_to_all import KJTAllToAllWithHead
from examples.spawn import run_on_ranks


class _Tagged(KJTAllToAllWithHead):
    def __init__(self, pg, splits, rank):
        super().__init__(pg=pg, splits=splits)
        self.rank, self.calls, self.received = rank, 0, []

    def head(self, num_splits):
        self.calls += 1
        rows = [[100 + self.rank] * self.world_size, [10 * self.calls] * self.world_size]
        return rows, self.received.append


def _exchange(rank: int, world_size: int):
    pg = dist.group.WORLD
    kjts = [KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([rank * 10 + i for i in range(2 + step + rank)]),
        torch.tensor([1 + step, 0, 1 + rank, 0])) for step in range(2)]
    tagged = _Tagged(pg, [1, 1], rank)
    plain = KJTAllToAll(pg=pg, splits=[1, 1])
    out = []
    for kjt in kjts:
        got, want = tagged(kjt).wait().wait(), plain(kjt).wait().wait()
        out.append((got.keys(), got.values().tolist(), got.lengths().tolist(),
                    want.keys(), want.values().tolist(), want.lengths().tolist()))
    return out, tagged.received


def test_the_head_reaches_every_peer_and_the_kjts_are_torchrecs():
    for rank, (exchanges, received) in enumerate(run_on_ranks(2, _exchange, timeout=120)):
        for got_keys, got_values, got_lengths, keys, values, lengths in exchanges:
            assert (got_keys, got_values, got_lengths) == (keys, values, lengths)
        # row 0: each peer's rank tag; row 1: the call number (both ranks call twice)
        assert received == [[[100, 101], [10, 10]], [[100, 101], [20, 20]]], rank
