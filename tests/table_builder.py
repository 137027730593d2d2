"""One dynamic table built directly (no collection), for the tests of dynemb/tables/."""
import torch

from dynemb import (DynamicEmbTableOptions, Initializer, InitializerKind, OptimizerConfig,
                    OptimizerType)
from dynemb.options import choose_storage_mode
from dynemb.tables import build_table
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
