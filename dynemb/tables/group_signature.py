"""Which tables can train as one group (:mod:`dynemb.tables.groups`): those that agree on
everything the group kernels read."""
from __future__ import annotations

from typing import Hashable, Optional

import torch

from dynemb.tables.base import DynamicTable
from dynemb.tables.policies import POLICIES

#: The modes whose tables group (their policy's ``groups``): HBM_DIRECT, CACHE (the device
#: tier grouped; each table's evicted rows go to its own store, and its new rows come from
#: it, table by table), HOST_ONLY (a record in host memory, by the host kernels; a module on
#: CUDA reads the rows and updates them there, as alone) and DEFAULT (both tiers grouped,
#: :mod:`dynemb.tables.group_tiers`).
GROUPED_MODES = tuple(mode for mode, policy in POLICIES.items() if policy.groups)


def group_signature(table: DynamicTable) -> Optional[Hashable]:
    """What tables of one group share, or None for a table that is a group of one whatever
    its partners (a table of a mode whose policy does not group: none today). Tables that stash their rows group with
    those of the same stash mode (a group's rows go and come back as one). Tables with
    admission group only with each other (their prefetch counts keys before it claims, so it
    cannot be taken back; a CACHE table counts the keys its store holds as stored, in its
    group as alone). A table of float16 / bfloat16 rows
    rounded with noise is a group of one: the noise is drawn per table (its seed and id),
    and the fused update takes one of each."""
    options = table.options
    hash_table = table.tier.hash
    admits = table.admission is not None
    if table.mode not in GROUPED_MODES:
        return None
    weights = table.tier.flat.weights
    alone = (table.name,) if rounds_with_noise(table) else ()
    return (table.mode, table.tier.device, table.tier.kernels.name, table.device,
            table.kernels.name, weights.dtype, table.dim,
            weights.shape[1], table.optimizer, hash_table.policy, hash_table.bucket_size,
            admits, options.stash, *alone)


def rounds_with_noise(table: DynamicTable) -> bool:
    """Whether the table's updates round float16 / bfloat16 rows with noise."""
    return table.tier.flat.weights.dtype != torch.float32 and table.options.stochastic_rounding
