"""HBM_DIRECT: the whole table lives in one device tier (hash table + flat table).

- prefetch (training): find or insert every key (admission first), evict by score when a
  bucket is full (the evicted row is simply dropped: the table is the only copy), initialize
  new rows, pin the slots. Eval: find only, unseen keys read the eval initializer.
- forward: gather the embedding columns by slot.
- backward: the fused optimizer updates the rows in place.
The device tier doubles (up to ``max_capacity``) when ``init_capacity`` starts it smaller.
"""
from __future__ import annotations

import torch

from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.base import DynamicTable
from dynemb.tables.batch import TableBatch
from dynemb.tables.memory import PlannedRows
from dynemb.types import EMPTY_KEY


class HbmDirectTable(DynamicTable):
    """See the module docstring.

    Example::

        >>> from dynemb.options import choose_storage_mode
        >>> from dynemb.tables import build_table
        >>> layout = choose_storage_mode(DynamicEmbTableOptions(), name="t", num_embeddings=1024,
        ...                              width=8, config_dtype=torch.float32)
        >>> layout.mode
        <StorageMode.HBM_DIRECT: 'hbm_direct'>
        >>> table = build_table("t", 0, 8, layout, DynamicEmbTableOptions(), OptimizerConfig(),
        ...                     torch.device("cpu"))
        >>> batch = table.prefetch(torch.tensor([7, 9, 7]), training=True)
        >>> table.lookup(batch).shape                            # one row per unique key
        torch.Size([2, 8])
    """

    mode = StorageMode.HBM_DIRECT

    @property
    def _grows(self) -> bool:
        return self.layout.init_capacity < self.layout.max_capacity

    @classmethod
    def planned_rows(cls, layout: TableLayout, options: DynamicEmbTableOptions) -> PlannedRows:
        """The device tier at the most it grows to, ``max_capacity`` rows; nothing on the host.

        Example::

            >>> from dynemb.options import choose_storage_mode
            >>> options = DynamicEmbTableOptions(max_capacity=512)
            >>> layout = choose_storage_mode(options, name="t", num_embeddings=1000, width=8,
            ...                              config_dtype=torch.float32)
            >>> HbmDirectTable.planned_rows(layout, options)  # max_capacity 512
            PlannedRows(device_rows=512, host_rows=0, host_hash_slots=0, host_exact=True)
        """
        return PlannedRows(device_rows=layout.max_capacity)

    def _resolve(self, batch: TableBatch) -> None:
        if batch.training:
            self._resolve_training(batch)
        else:
            self._resolve_eval(batch)

    def _resolve_training(self, batch: TableBatch) -> None:
        self._finish_training(batch, self._claim_training(batch))

    def claims_apart(self, training: bool) -> bool:
        # admission counts a batch's keys before it claims: that part is not taken back
        return training and self.admission is None

    def _claim_training(self, batch: TableBatch):
        claim = batch.keys
        if self.admission is not None:
            admitted = self._admit(batch, self._present(batch.keys))
            claim = torch.where(admitted, batch.keys, EMPTY_KEY)
        result = self._claim(self.tier, claim, batch.counts, batch.score)
        batch.slots = result.slots
        self._hold(batch)
        return result

    def _finish_training(self, batch: TableBatch, result) -> None:
        try:
            self._fill_new_rows(batch.keys, result)
        except BaseException:  # e.g. a CACHE store's disk is full: the claim is undone
            self._undo_claim(batch, result)
            raise
        self._count_claim(self.tier, batch, result)

    def _undo_claim(self, batch: TableBatch, result) -> None:
        """Put the table back as it was before ``batch``'s claim (``result``), whose rows
        were not filled: the keys it evicted are back in their slots, with their rows,
        which nothing overwrote. The batch holds no pins after."""
        self.tier.hash.undo(result)
        batch.slots = torch.full_like(result.slots, -1)

    def _present(self, keys: torch.Tensor) -> torch.Tensor:
        """[U] bool: the key is stored already (admission lets stored keys through)."""
        slots = self.tier.hash.find(keys.to(self.tier.device), allow_padding=True)
        return (slots >= 0).to(self.device)

    def fill_claimed_rows(self, keys: torch.Tensor, result) -> None:
        """What the table does with the rows a claim of ``keys`` gave (``result``, a
        :class:`~dynemb.types.FindOrInsertResult` in its own slots) when its group made the
        claim (:mod:`dynemb.tables.groups`): CACHE writes the evicted rows back and loads
        the new ones from its store."""
        self._fill_new_rows(keys, result)

    def _fill_new_rows(self, keys: torch.Tensor, result) -> None:
        """Rows of keys inserted by this claim start from the initializer."""
        self._initialize(self.tier, result, keys.to(self.tier.device))

    def _resolve_eval(self, batch: TableBatch) -> None:
        """Find without inserting or rescoring; found slots stay pinned until forward."""
        slots = self.tier.hash.find(batch.keys.to(self.tier.device), allow_padding=True)
        self.tier.hash.retain(slots)
        batch.slots = slots
        self._hold(batch)
        batch.fallback = self._eval_fallback(batch.keys)  # a store may fail: count after
        found = (slots >= 0).to(self.device)
        self.counters.add("hits", found.sum())
        self.counters.add("misses", batch.num_unique.sum() - found.sum())

    def _eval_fallback(self, keys: torch.Tensor) -> torch.Tensor:
        return self._eval_rows(keys)

    def lookup(self, batch: TableBatch) -> torch.Tensor:
        # read the embedding columns only, not the optimizer state behind them
        embeddings = self.tier.flat.weights[:, :self.dim]
        rows = embeddings.index_select(0, batch.slots.clamp(min=0)).float()
        return self._with_fallback(rows, batch.slots >= 0, batch.fallback)

    def lookup_occurrences(self, batch: TableBatch) -> torch.Tensor:
        if batch.fallback is not None or self.kernels.defers_failures:
            return super().lookup_occurrences(batch)
        # every key is stored: one gather of the embedding columns, straight per occurrence
        slots = batch.slots.index_select(0, batch.inverse).clamp(min=0)
        return self.tier.flat.weights[:, :self.dim].index_select(0, slots).float()

    def rows_in_place(self, batch: TableBatch):
        """(float32 device rows [C, W], slot of each input key [N]) when every key of the
        batch has a float32 device row that can be read where it is (no fallback rows), so
        a kernel can pool straight from the table; else None."""
        weights = self.tier.flat.weights
        if (weights.dtype != torch.float32 or batch.fallback is not None
                or self.kernels.defers_failures):
            return None
        return weights, batch.slots.index_select(0, batch.inverse)

    def _update(self, batch: TableBatch, grads, lr: float, step: int) -> None:
        slots = self._live_slots(self.tier, batch.slots, batch)
        self._fused_update(self.tier.flat.weights, slots, grads, batch.keys, lr, step)

    # -- checkpoint ----------------------------------------------------------------------------
    def _insert_saved_rows(self, keys: torch.Tensor, scores: torch.Tensor,
                           rows: torch.Tensor) -> None:
        """Saved rows go to the device tier: it is the whole table."""
        self._insert_into_tier("device", self.tier, keys, scores, rows)
