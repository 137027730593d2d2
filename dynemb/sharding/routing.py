"""Which rank owns each key, and the deduplicated, rank-ordered ids a rank sends out.

Row-wise sharding of an unbounded id space has no row blocks to split: a key's owner is
``key mod world`` or a hash of it (:class:`~dynemb.options.ShardingScheme`). Before the
all-to-all each rank sends every distinct id once per table; the ``gather`` index maps each
original occurrence back to the row of its unique id in what comes back, so the returned
embeddings expand to one per occurrence and their gradients sum per unique id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.backends.protocol import EMPTY_KEY, KernelBackend, Segments
from dynemb.foundations.key_mixing import owner_rank_hash
from dynemb.options import ShardingScheme


def owner_ranks(keys: torch.Tensor, world_size: int, scheme: ShardingScheme) -> torch.Tensor:
    """The rank (int64, in ``[0, world_size)``) that owns each key.

    HASH mixes ``key + salt`` (:func:`dynemb.foundations.key_mixing.owner_rank_hash`), so the
    owner is independent of the bucket a table's own hash (of ``key``) picks: the keys of one rank
    still spread over all buckets.

    Example::

        >>> owner_ranks(torch.tensor([7, -3, 10]), 4, ShardingScheme.MOD).tolist()
        [3, 1, 2]
    """
    if scheme is ShardingScheme.MOD:
        return torch.remainder(keys, world_size)
    return owner_rank_hash(keys, world_size)


@dataclass
class RoutedIds:
    """One rank's outgoing ids for a group of tables.

    ``values`` holds each table's distinct ids, ordered by destination rank, then table, and
    ``counts`` how many times each occurred; ``lengths[r * T + t]`` of them go to rank ``r``
    for table ``t``. ``gather[i]`` is the
    position in ``values`` of the ``i``-th occurrence, occurrences listed table by table in
    the order of ``segments`` (``(feature, count)`` pairs).
    """

    values: torch.Tensor
    counts: torch.Tensor
    lengths: torch.Tensor
    gather: torch.Tensor
    segments: List[Tuple[str, int]]


def route_unique(ids_per_table: Sequence[torch.Tensor], schemes: Sequence[ShardingScheme],
                 world_size: int, segments: List[Tuple[str, int]],
                 kernels: Optional[KernelBackend] = None) -> RoutedIds:
    """Dedup each table's ids and order the distinct ids by (owner rank, table).

    ``kernels`` dedup the ids of every table (default: the kernels of the ids' device, one
    device for all tables)."""
    num_tables = len(ids_per_table)
    device = ids_per_table[0].device
    kernels = resolve_kernels(device, kernels=kernels)
    if not kernels.defers_failures and num_tables > 1 and len(set(schemes)) == 1:
        # every table in one dedup call, one owner computation (the same ids and order
        # as table by table: each table's distinct ids in first-occurrence order; kernels
        # that defer failures, which do not wait for the device, dedup table by table)
        bounds = [0]
        for ids in ids_per_table:
            bounds.append(bounds[-1] + ids.numel())
        per_table = Segments(bounds, device)
        padded, inverse, padded_counts, _ = kernels.dedup_segments(
            torch.cat(list(ids_per_table)), per_table)
        real = padded != EMPTY_KEY  # each table's unique ids, without the padding
        inverse = (torch.cumsum(real, 0) - 1)[inverse]
        all_unique, all_counts = padded[real], padded_counts[real]
        table_of = per_table.table_of[real]
        group = owner_ranks(all_unique, world_size, schemes[0]) * num_tables + table_of
    else:
        uniques, inverses, counts, groups, before = [], [], [], [], 0
        for t, (ids, scheme) in enumerate(zip(ids_per_table, schemes)):
            unique, table_inverse, count = kernels.dedup(ids)
            uniques.append(unique)
            inverses.append(table_inverse + before)
            before += unique.numel()
            counts.append(count)
            groups.append(owner_ranks(unique, world_size, scheme) * num_tables + t)
        all_unique, all_counts = torch.cat(uniques), torch.cat(counts)
        inverse, group = torch.cat(inverses), torch.cat(groups)
    order = torch.sort(group, stable=True).indices
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=device)
    lengths = torch.bincount(group, minlength=world_size * num_tables).to(torch.int32)
    return RoutedIds(all_unique[order], all_counts[order], lengths, position[inverse],
                     segments)
