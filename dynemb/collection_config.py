"""Checks of a collection's table configs and the per-table options they are given."""
from __future__ import annotations

from typing import Dict, List, Mapping

from torchrec.modules.embedding_configs import EmbeddingConfig

from dynemb.options import DynamicEmbTableOptions


def check_configs(tables, config_type: type = EmbeddingConfig) -> List[EmbeddingConfig]:
    """``tables`` as a list of ``config_type`` (``EmbeddingConfig``, or ``EmbeddingBagConfig``
    for a pooled collection): unique valid names (see :func:`check_table_name`), positive dims,
    each feature in one table (a table without feature names reads the feature named after
    it)."""
    kind = config_type.__name__
    if not isinstance(tables, (list, tuple)) or not tables:
        raise ValueError(f"tables must be a non-empty list of {kind}")
    seen, features = set(), {}
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
        for f in config.feature_names:
            if f in features:
                raise ValueError(f"feature {f!r} is in tables {features[f]!r} and "
                                 f"{config.name!r}; a feature reads one table")
            features[f] = config.name
    return list(tables)


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
