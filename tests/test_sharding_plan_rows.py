"""How a table's global row counts and budget split over the ranks of a row-wise sharding."""
from torchrec import EmbeddingConfig
from torchrec.modules.embedding_configs import DataType

from dynemb import DynamicEmbTableOptions, FrequencyAdmission
from dynemb.modules.rank_share import local_table_config, local_table_options, rows_per_rank


def test_rows_per_rank_rounds_up_and_gives_every_rank_a_row():
    assert [rows_per_rank(rows, 4) for rows in (1, 4, 5, 4001)] == [1, 1, 2, 1001]
    assert rows_per_rank(1, 8) == 1 and rows_per_rank(7, 1) == 7


def test_local_table_options_split_global_rows():
    opts = DynamicEmbTableOptions(init_capacity=1000, max_capacity=4001,
                                  admission=FrequencyAdmission(threshold=2, counter_capacity=300))
    local = local_table_options(opts, 4)
    assert (local.init_capacity, local.max_capacity) == (250, 1001)
    assert local.admission.counter_capacity == 75 and local.admission.threshold == 2
    assert local_table_options(DynamicEmbTableOptions(), 4).max_capacity is None


def test_global_budget_becomes_the_rank_share_unless_a_local_one_is_set():
    local = local_table_options(DynamicEmbTableOptions(global_hbm_for_values=1000), 3)
    assert (local.local_hbm_for_values, local.global_hbm_for_values) == (333, None)
    both = DynamicEmbTableOptions(global_hbm_for_values=1000, local_hbm_for_values=50)
    local = local_table_options(both, 3)
    assert (local.local_hbm_for_values, local.global_hbm_for_values) == (50, 1000)


def test_local_table_config_is_read_by_one_feature_named_after_the_table():
    config = EmbeddingConfig(name="items", embedding_dim=8, num_embeddings=1001,
                             feature_names=["a", "b"], data_type=DataType.FP16)
    local = local_table_config(config, 4)
    assert (local.name, local.embedding_dim, local.num_embeddings, local.feature_names,
            local.data_type) == ("items", 8, 251, ["items"], DataType.FP16)
