"""One dynamic table built directly (no collection), or in a one-table collection, for the
tests of dynemb/tables/; a bare table runs its batches as a group of one
(:func:`dynemb.tables.grouping.group_of_one`), as a module runs it."""
import weakref

import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType)
from dynemb.options import choose_storage_mode
from dynemb.rows.occurrence_grads import OccurrenceGrads
from dynemb.tables import build_table
from dynemb.tables.grouping import group_of_one
from key_reference import initial_rows

DIM = 4
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=0.5)
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)
TABLE_ID = 12345


def build(num_embeddings=64, optimizer=SGD, **options):
    options.setdefault("initializer", INIT)
    opts = DynamicEmbTableOptions(**options)
    state_dim = optimizer.state_dim(DIM)
    layout = choose_storage_mode(opts, name="t", num_embeddings=num_embeddings,
                                 width=DIM + state_dim, state_dim=state_dim,
                                 config_dtype=torch.float32)
    return build_table("t", TABLE_ID, DIM, layout, opts, optimizer, torch.device("cpu"))


def start_rows(keys, seed=0):
    """The rows INIT gives ``keys`` of this table (the Python reference)."""
    return torch.tensor(initial_rows(INIT, keys, DIM, seed=seed, table_id=TABLE_ID))


def collection(num_embeddings, initializer=INIT, **options):
    """A collection of one table "t" read by feature "f", trained by SGD at lr 0.5."""
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=num_embeddings,
                              feature_names=["f"])]
    return DynamicEmbCollection(tables, table_options=DynamicEmbTableOptions(
        initializer=initializer, **options), optimizer=SGD)


def train_step(ec, ids):
    """One step whose loss is the sum of all embeddings: each row moves by -lr per use.
    Returns the embeddings of ``ids``."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    out = ec(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()])))
    out["f"].values().sum().backward()
    return out["f"].values()


_GROUPS = weakref.WeakKeyDictionary()


def group_of(table):
    """The table's group of one, the same one for every batch (as a module keeps its groups:
    a growth moves the batches of the group that grows)."""
    group = _GROUPS.get(table)
    if group is None or not group.intact({table.name: table}):
        group = _GROUPS[table] = group_of_one(table)
    return group


def prefetch(table, keys, training=True, occurrences=None, score=None):
    """``table``'s batch of ``keys`` through its group of one: a training prefetch (claimed,
    filled and pinned) or a read-only lookup."""
    group = group_of(table)
    if training:
        return group.prefetch([keys], [occurrences], [score])
    return group.lookup_batch([keys], [occurrences])


def rows_of(batch):
    """[N, dim] the row each input key of ``batch`` reads (a forward's lookup)."""
    return batch.lookup_occurrences()[0]


def update(table, batch, unique_grads, *, lr, step):
    """The backward of ``batch``: ``unique_grads`` [U, dim], one per unique key in the
    batch's order (``batch.keys``), at ``lr`` and ``step``; then its pins end."""
    batch.apply_gradients(OccurrenceGrads.of_rows(unique_grads), [True], lr=lr,
                          steps={table.name: step})
