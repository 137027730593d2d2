"""A host backing store whose writes fail on demand, for the tests of what a failed CACHE
write-back leaves behind."""
from dynemb.stores.backing_store import HostBackingStore


class FailingStore(HostBackingStore):
    """A host store whose writes fail while ``failing`` is set (a full disk, say)."""

    failing = False

    def insert(self, keys, rows, scores):
        if FailingStore.failing:
            raise OSError("the store's disk is full")
        return super().insert(keys, rows, scores)
