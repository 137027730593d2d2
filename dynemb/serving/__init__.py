"""Export of trained dynamic tables for serving stacks that have no hash table.

- :func:`iter_rows`: every live ``(key, embedding)`` of one table, in bounded chunks;
- :func:`to_static`: a plain TorchRec module holding the trained rows (an
  ``EmbeddingCollection`` for a :class:`~dynemb.DynamicEmbCollection`, an
  ``EmbeddingBagCollection`` for a :class:`~dynemb.DynamicEmbBagCollection`), and per table
  an :class:`IdRemap` (raw int64 id -> row index: sorted keys and ``torch.searchsorted``, no
  hash table), built by streaming through :func:`iter_rows`;
- :class:`StaticServingCollection` (:class:`StaticServingBagCollection` for pooled exports):
  the two together, ``forward(kjt)`` as the dynamic module's eval forward;
- :func:`merge_exports`: one export of several ranks' exports of a sharded module.

Row ``i`` of a static table holds the ``i``-th smallest live key; the last row (index
``num_keys``) is the **default row**, what every unknown id reads. It holds what the dynamic
module returns in eval for an unseen id when that is a constant (``eval_initializer`` of
kind CONSTANT: its value, 0.0 by default); for the other kinds, whose eval rows depend on the
id, it holds zeros, and :func:`to_static` warns that unseen ids will differ.

One job a module: :mod:`~dynemb.serving.export` (the sequence export and the entry points),
:mod:`~dynemb.serving.pooled` (the pooled export), :mod:`~dynemb.serving.tables` (rows of
dynamic tables into static ones), :mod:`~dynemb.serving.remap` (raw ids to rows).

Shapes: ``N`` ids, ``K`` live keys of a table, ``D`` its embedding dim.

Example (a full one runs in :func:`to_static`)::

    >>> ec, remaps = to_static(trained_module)  # doctest: +SKIP
    >>> serving = StaticServingCollection(ec, remaps)  # doctest: +SKIP
    >>> out = serving(kjt)  # doctest: +SKIP
"""
from dynemb.serving.export import (StaticExport, StaticServingCollection, merge_exports,
                                   to_static)
from dynemb.serving.pooled import StaticBagExport, StaticServingBagCollection
from dynemb.serving.remap import IdRemap
from dynemb.serving.tables import iter_rows

__all__ = ["IdRemap", "StaticBagExport", "StaticExport", "StaticServingBagCollection",
           "StaticServingCollection", "iter_rows", "merge_exports", "to_static"]
