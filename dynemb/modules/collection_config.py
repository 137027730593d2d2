"""Checks of a collection's table configs and the per-table options they are given."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torchrec.modules.embedding_configs import (BaseEmbeddingConfig, EmbeddingConfig,
                                                data_type_to_dtype)
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from dynemb.rows.initializers import table_identity
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import (DynamicEmbTableOptions, TableLayout, choose_storage_mode,
                            resolve_initializer)
from dynemb.stashing.collection_stash import resolve_stash_options
from dynemb.tables import DynamicTable, build_table
from dynemb.tables.allocation_checks import check_allocations


def check_configs(tables, config_type: type = EmbeddingConfig) -> List[EmbeddingConfig]:
    """``tables`` as a list of ``config_type`` (``EmbeddingConfig``, or ``EmbeddingBagConfig``
    for a pooled collection): unique valid names (see :func:`check_table_name`), positive dims,
    each feature at most once per table (a table without feature names reads the feature
    named after it). A feature may feed several tables, as in TorchRec: its outputs are then
    named ``feature@table`` (see :func:`output_names_by_table`)."""
    kind = config_type.__name__
    if not isinstance(tables, (list, tuple)) or not tables:
        raise ValueError(f"tables must be a non-empty list of {kind}")
    seen = set()
    for config in tables:
        if not isinstance(config, config_type):
            raise TypeError(f"tables must hold {kind}, got {type(config).__name__}")
        check_table_name(config.name)
        if config.name in seen:
            raise ValueError(f"table names must be unique, got {config.name!r} twice")
        seen.add(config.name)
        if config.embedding_dim <= 0:
            raise ValueError(f"table {config.name!r}: embedding_dim must be positive, got "
                             f"{config.embedding_dim}")
        if not config.feature_names:
            config.feature_names = [config.name]
        twice = sorted({f for f in config.feature_names if config.feature_names.count(f) > 1})
        if twice:
            raise ValueError(f"table {config.name!r} lists features {twice} more than once; "
                             f"a table reads each feature once")
    return list(tables)


def output_names_by_table(configs: List[BaseEmbeddingConfig]) -> List[List[str]]:
    """TorchRec's output names, table by table, each table's features in config order: the
    feature's name, or ``feature@table`` for a feature that several tables read
    (``torchrec.modules.embedding_modules.get_embedding_names_by_table``).

    Example::

        >>> output_names_by_table([
        ...     EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=8,
        ...                     feature_names=["f1", "f2"]),
        ...     EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=8,
        ...                     feature_names=["f2"])])
        [['f1', 'f2@t1'], ['f2@t2']]
    """
    return get_embedding_names_by_table(list(configs))


def output_name_of(configs: List[BaseEmbeddingConfig]) -> Dict[Tuple[str, str], str]:
    """``(table, feature) -> output name`` (see :func:`output_names_by_table`)."""
    return {(c.name, f): name for c, names in zip(configs, output_names_by_table(configs))
            for f, name in zip(c.feature_names, names)}


def check_table_name(name) -> None:
    """Refuse a table name that TorchRec's ``EmbeddingCollection`` refuses: not a string,
    empty, or holding ``"."``. Names become ``state_dict`` keys (``dynamic_tables.<name>...``),
    where a dot would split them, so a module with such a name could save but never load.

    Example::

        >>> check_table_name("items")
        >>> check_table_name("user.ids")
        Traceback (most recent call last):
        KeyError: 'table name ... contains "."; ...'
    """
    if not isinstance(name, str):
        raise TypeError(f"table name must be a str, got {type(name).__name__} {name!r}")
    if not name:
        raise KeyError('table name can\'t be empty ""')
    if "." in name:
        raise KeyError(f'table name {name!r} contains "."; TorchRec\'s EmbeddingCollection '
                       f'refuses it too (it names a module, and state_dict keys are split at '
                       f'dots): use another separator, e.g. {name.replace(".", "_")!r}')


def settle_table_options(table_options, configs: List[BaseEmbeddingConfig],
                         optimizer: OptimizerConfig) -> Dict[str, DynamicEmbTableOptions]:
    """Each table's options as the module runs them: :func:`options_by_table`, then the stash
    mode (from TorchRec's ``stash_weights``) and the initializer (from the config's
    ``weight_init_min/max`` or ``init_fn``) settled against the table's config."""
    options = options_by_table(table_options, [c.name for c in configs])
    options = resolve_stash_options(options, configs, optimizer)
    return {c.name: resolve_initializer(options[c.name], c) for c in configs}


def options_by_table(table_options, names) -> Dict[str, DynamicEmbTableOptions]:
    """One :class:`DynamicEmbTableOptions` per table name, from one for all or a dict."""
    if table_options is None or isinstance(table_options, DynamicEmbTableOptions):
        return {n: table_options or DynamicEmbTableOptions() for n in names}
    if not isinstance(table_options, Mapping):
        raise TypeError("table_options must be DynamicEmbTableOptions or a dict of them by "
                        f"table name, got {type(table_options).__name__}")
    unknown = sorted(set(table_options) - set(names))
    if unknown:
        raise ValueError(f"table_options names unknown tables {unknown}; tables: {names}")
    out = {}
    for n in names:
        opt = table_options.get(n, DynamicEmbTableOptions())
        if not isinstance(opt, DynamicEmbTableOptions):
            raise TypeError(f"table_options[{n!r}] must be DynamicEmbTableOptions, got {opt!r}")
        out[n] = opt
    return out


def table_layout(config: BaseEmbeddingConfig, options: DynamicEmbTableOptions,
                 optimizer: OptimizerConfig) -> TableLayout:
    """The storage mode and sizes ``options`` choose for ``config``'s table (checked)."""
    state_dim = optimizer.state_dim(config.embedding_dim)
    return choose_storage_mode(
        options, name=config.name, num_embeddings=config.num_embeddings,
        width=config.embedding_dim + state_dim, state_dim=state_dim,
        config_dtype=data_type_to_dtype(config.data_type))


def build_configured_tables(configs: List[BaseEmbeddingConfig],
                            options: Mapping[str, DynamicEmbTableOptions],
                            optimizer: OptimizerConfig, device: torch.device,
                            backend: Optional[str]) -> Dict[str, DynamicTable]:
    """Every config's table, empty, in the storage mode its options choose; nothing on the
    meta device (after checking the options). What all the tables allocate up front is
    checked against the memory, together, before any is allocated."""
    layouts = [(c, table_layout(c, options[c.name], optimizer)) for c in configs]
    if device.type == "meta":
        return {}
    check_allocations([(c.name, layout, options[c.name]) for c, layout in layouts],
                      device=device)
    return {c.name: build_table(c.name, table_identity(c.name), c.embedding_dim, layout,
                                options[c.name], optimizer, device, backend)
            for c, layout in layouts}
