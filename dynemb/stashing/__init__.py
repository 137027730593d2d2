"""Embedding memory stashing (EMS) for dynamic tables: between a training forward's lookup and
its backward, a table's device rows wait in host memory and their device memory is free for
activations.

Turn it on per table with ``DynamicEmbTableOptions(stash=StashMode.ALL)`` (or ``VALUES`` /
``OPTIMIZER_STATE``), or TorchRec's ``EmbeddingConfig(stash_weights=True)``. Then:

- every training forward stashes the tables after its lookups, and their backward restores
  them (at the latest);
- TorchRec's EMS pipelines restore them earlier, at their injection site:
  :class:`~dynemb.pipelines.TrainPipelineSparseDistEmbStash` and
  :class:`~dynemb.pipelines.TrainPipelinePrefetchEMS` (TorchRec's, also on CPU);
- in a plain loop, :func:`restore_on_grad` does the same from a tensor's gradient hook;
- the module brings them back first before anything else reads or moves them (the next
  prefetch's loads, an eval or ``no_grad`` forward, ``read_rows``, ``state_dict``, a
  checkpoint load, a new step after an exception); new rows made by a prefetch meanwhile are
  written when they return. Nothing stands in for the rows meanwhile: the tables' tensors
  are empty.

The machinery has one module a job: :mod:`~dynemb.stashing.collection_stash` (a module's
tables together, :func:`~dynemb.stashing.collection_stash.resolve_stash_options`),
:mod:`~dynemb.stashing.table_stash` (a table's or a group's rows: ``TableStash``,
``stashed_columns``, ``stashed_bytes_per_row``), :mod:`~dynemb.stashing.transfers` (how the
bytes move). See docs/ems.md for when it pays and what it costs.
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from dynemb.module_interface import find_dynamic_modules
from dynemb.stashing.collection_stash import CollectionStash


def collection_stashes(model: nn.Module) -> List[CollectionStash]:
    """The :class:`CollectionStash` of every dynamic collection in ``model`` that stashes
    (a sharded module's are those of its ``local`` collection)."""
    return [m.memory_stash for m in find_dynamic_modules(model).values()
            if m.memory_stash is not None]


def restore(model: nn.Module) -> None:
    """Bring back the rows of every stashed table in ``model`` now (on CUDA: enqueue the
    copies; the streams that use the rows wait for them)."""
    for stash in collection_stashes(model):
        stash.restore()


def restore_on_grad(tensor: torch.Tensor, model: nn.Module):
    """Restore ``model``'s stashed tables when backward reaches ``tensor`` (its gradient is
    computed): a plain training loop's way of starting the copies before the embedding
    backward needs them, as TorchRec's EMS pipelines do at their injection site. Call it on
    each step's tensor (e.g. the input of the top MLP); returns the hook's handle.

    Example::

        >>> loss, over_input = model(batch)  # doctest: +SKIP
        >>> restore_on_grad(over_input, model)  # doctest: +SKIP
        >>> loss.backward()  # doctest: +SKIP
    """
    stashes = collection_stashes(model)

    def hook(grad: torch.Tensor) -> None:
        for stash in stashes:
            stash.restore()

    return tensor.register_hook(hook)


__all__ = ["CollectionStash", "collection_stashes", "restore", "restore_on_grad"]
