"""Which tables of a module train as one group (:mod:`dynemb.tables.groups`): those that agree
on everything the group kernels read; every table is in one group, a table with no partner in
a group of one.

Example::

    >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
    >>> from dynemb.rows.optimizers import OptimizerConfig
    >>> from dynemb.tables import build_table
    >>> def table(name, dim=4):
    ...     layout = choose_storage_mode(DynamicEmbTableOptions(), name=name, num_embeddings=512,
    ...                                  width=dim, config_dtype=torch.float32)
    ...     return build_table(name, 0, dim, layout, DynamicEmbTableOptions(), OptimizerConfig(),
    ...                        torch.device("cpu"))
    >>> tables = {"a": table("a"), "b": table("b"), "c": table("c", dim=8)}
    >>> [group.names for group in group_tables(tables)]
    [('a', 'b'), ('c',)]
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Mapping, Optional, Union

from dynemb.options import StorageMode
from dynemb.tables.base import DynamicTable
from dynemb.tables.group_tiers import TieredGroup
from dynemb.tables.groups import TableGroup
from dynemb.tables.policies import POLICIES

#: The modes whose tables group (their policy's ``groups``): HBM_DIRECT, CACHE (the device
#: tier grouped; each table's evicted rows go to its own store, and its new rows come from
#: it, table by table), HOST_ONLY (a record in host memory, by the host kernels; a module on
#: CUDA reads the rows and updates them there, as alone) and DEFAULT (both tiers grouped,
#: :mod:`dynemb.tables.group_tiers`).
GROUPED_MODES = tuple(mode for mode, policy in POLICIES.items() if policy.groups)


def group_signature(table: DynamicTable) -> Optional[Hashable]:
    """What tables of one group share, or None for a table that is a group of one whatever
    its partners (a table of a mode whose policy does not group: none today). Tables that
    stash their rows group with those of the same stash mode (a group's rows go and come back
    as one). Tables with admission group only with each other (their prefetch counts keys
    before it claims, so it cannot be taken back; a CACHE table counts the keys its store
    holds as stored, in its group as alone). A table of float16 / bfloat16 rows rounded with
    noise is a group of one: the noise is drawn per table (its seed and id), and the fused
    update takes one of each."""
    options = table.options
    hash_table = table.tier.hash
    admits = table.admission is not None
    if table.mode not in GROUPED_MODES:
        return None
    weights = table.tier.flat.weights
    alone = (table.name,) if table.rounds_with_noise else ()
    return (table.mode, table.tier.device, table.tier.kernels.name, table.device,
            table.kernels.name, weights.dtype, table.dim,
            weights.shape[1], table.optimizer, hash_table.policy, hash_table.bucket_size,
            admits, options.stash, *alone)


def group_tables(tables: Mapping[str, DynamicTable], *, apart: bool = False
                 ) -> List[Union[TableGroup, TieredGroup]]:
    """The groups of ``tables``, in table order: every table is in one, a table with no
    partner in a group of one (``apart``: every table; so is a table whose
    :func:`group_signature` is None). DEFAULT tables form a
    :class:`~dynemb.tables.group_tiers.TieredGroup`, the others a
    :class:`~dynemb.tables.groups.TableGroup`.

    A group of one cost what the table's own path cost, or less, while tables had one
    (``benchmarks/README.md``, ``bench_group_of_one``; on CUDA 30 launches a step against 80,
    ``benchmarks/step_census.py``)."""
    by_signature: Dict[Hashable, List[DynamicTable]] = {}
    for name, table in tables.items():
        signature = group_signature(table)
        alone = apart or signature is None
        by_signature.setdefault((signature, name) if alone else signature, []).append(table)
    return [_group_class(members[0])(members) for members in by_signature.values()]


def group_of_one(table: DynamicTable) -> Union[TableGroup, TieredGroup]:
    """``table`` as a group of one over its arrays as they are (views of its module's group
    included: nothing is copied and the module's group stays whole), for work on one table
    outside its module's steps (:func:`~dynemb.tables.fill.fill_to_load_factor`)."""
    return _group_class(table)([table], in_place=True)


def _group_class(table: DynamicTable):
    return TieredGroup if table.mode is StorageMode.DEFAULT else TableGroup
