"""HOST_ONLY tables (a device budget of 0 bytes): the layout and its refusals, where the
arrays live, stats / memory / the planner's footprint, and training that gives the rows of an
HBM_DIRECT twin bit for bit (both backends, sequence and pooled, admission and eviction)."""
import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    FrequencyAdmission, Initializer, InitializerKind, OptimizerConfig,
                    OptimizerType, ScorePolicy, StorageMode)
from dynemb.options import StashMode, choose_storage_mode
from dynemb.planning import measure_allocated, table_footprint
from dynemb.modules.rank_share import local_table_options
from dynemb.tables import HostOnlyTable
from dynemb.tables.allocation_checks import check_allocation

DIM = 8
ADAM = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)
ROW_BYTES = 3 * DIM * 4  # Adam: values and two states


def layout(**options):
    return choose_storage_mode(DynamicEmbTableOptions(**options), name="t", num_embeddings=1000,
                               width=3 * DIM, state_dim=2 * DIM, config_dtype=torch.float32)


def test_a_zero_budget_is_host_only():
    for options in (dict(local_hbm_for_values=0), dict(global_hbm_for_values=0),
                    dict(local_hbm_for_values=0, caching=True)):
        got = layout(max_capacity=512, **options)
        assert (got.mode, got.device_capacity, got.max_capacity) == (
            StorageMode.HOST_ONLY, 0, 512)
    # sharded: a global 0 stays 0 on every rank; a small global budget is not rounded to 0
    assert local_table_options(DynamicEmbTableOptions(global_hbm_for_values=0),
                               8).local_hbm_for_values == 0
    assert local_table_options(DynamicEmbTableOptions(global_hbm_for_values=4),
                               8).local_hbm_for_values == 1


@pytest.mark.parametrize("options, error, match", [
    (dict(local_hbm_for_values=ROW_BYTES), ValueError, "below one bucket .* a budget of 0 keeps"),
    (dict(global_hbm_for_values=-1), ValueError, "global_hbm_for_values must be"),
    (dict(local_hbm_for_values=0.0), TypeError, "local_hbm_for_values must be an int"),
    (dict(local_hbm_for_values=0, stash=StashMode.ALL), ValueError, "stash=ALL .*HOST_ONLY"),
])
def test_bad_budgets_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        layout(**options)


def test_host_rows_beyond_the_host_memory_are_refused():
    huge = choose_storage_mode(DynamicEmbTableOptions(local_hbm_for_values=0), name="t",
                               num_embeddings=2**36, width=3 * DIM, state_dim=2 * DIM,
                               config_dtype=torch.float32)
    assert huge.mode is StorageMode.HOST_ONLY
    with pytest.raises(ValueError, match=r"host rows of max_capacity.* on cpu.*lower max_capacity"):
        check_allocation(huge, DynamicEmbTableOptions(local_hbm_for_values=0), name="t",
                         device=torch.device("cpu"))


def _sequence(backend, device, budget, **options):
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=200,
                              feature_names=["f"])]
    return DynamicEmbCollection(tables, table_options=DynamicEmbTableOptions(
        initializer=INIT, local_hbm_for_values=budget, **options), optimizer=ADAM,
        device=device, backend=backend)


def _bags(backend, device, budget, **options):
    tables = [EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=200,
                                 feature_names=["f"], pooling=PoolingType.MEAN)]
    return DynamicEmbBagCollection(tables, table_options=DynamicEmbTableOptions(
        initializer=INIT, local_hbm_for_values=budget, **options), optimizer=ADAM,
        device=device, backend=backend)


def _batches(steps, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 5, (6,), generator=gen)
        ids = torch.randint(0, 400, (int(lengths.sum()),), generator=gen) * 7919 - 500
        out.append(KeyedJaggedTensor.from_lengths_sync(["f"], ids.to(device), lengths.to(device)))
    return out


def _values(out):
    return out["f"].values() if isinstance(out, dict) else out.values()


def _train(module, kjts):
    outs = []
    for kjt in kjts:
        values = _values(module(kjt))
        (values ** 2).sum().backward()
        outs.append(values.detach().cpu())
    return outs


def test_the_rows_live_in_host_memory(backend):
    backend, device = backend
    ec = _sequence(backend, device, 0, max_capacity=256, bucket_size=32)
    table = ec.tables["t"]
    assert ec.storage_modes() == {"t": StorageMode.HOST_ONLY} and isinstance(table,
                                                                               HostOnlyTable)
    assert table.tier.device == torch.device("cpu") and table.tier.kernels.name == "cpu"
    assert table.tier.flat.weights.shape == (256, 3 * DIM)
    _train(ec, _batches(3, device))
    stats = ec.stats()["t"]
    stored = table.tier.hash.size()
    assert stored > 0 and stats["storage_mode"] == "host_only"
    assert (stats["rows_device"], stats["device_capacity"], stats["rows_backing"]) == (
        0, 0, stored)
    memory = table.memory_breakdown()
    assert memory.values_bytes == memory.optimizer_bytes == memory.hash_bytes == 0
    assert memory.host_values_bytes == 256 * DIM * 4
    assert memory.host_optimizer_bytes == 256 * 2 * DIM * 4
    assert memory.host_hash_bytes == table.tier.hash.nbytes()


@pytest.mark.parametrize("world", [1, 2])
def test_the_footprint_counts_host_bytes(world):
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=3000,
                             feature_names=["t"])
    options = DynamicEmbTableOptions(global_hbm_for_values=0,
                                     admission=FrequencyAdmission(threshold=2,
                                                                  counter_capacity=1000))
    fp = table_footprint(config, options, ADAM, world_size=world)
    assert fp.mode is StorageMode.HOST_ONLY and fp.device_rows == 0
    assert fp.values_bytes == fp.optimizer_bytes == fp.hash_bytes == 0
    local = local_table_options(options, world)
    rank = DynamicEmbCollection(
        [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=-(-3000 // world),
                         feature_names=["t"])], "cpu", table_options={"t": local},
        optimizer=ADAM)
    actual = measure_allocated(rank)["t"]
    assert fp.host_rows == rank.tables["t"].tier.hash.capacity
    assert (fp.host_values_bytes, fp.host_optimizer_bytes, fp.host_hash_bytes) == (
        actual.host_values_bytes, actual.host_optimizer_bytes, actual.host_hash_bytes)
    # the device keeps only the counters and the admission counter
    assert fp.admission_bytes == actual.admission_bytes > 0
    assert fp.device_static_bytes == actual.device_bytes
    assert fp.host_bytes >= actual.host_bytes


TWINS = {
    "plain": dict(max_capacity=1024, bucket_size=32),
    # evicting: 128 slots for about 400 ids; admission refuses first sightings
    "evicting_admission": dict(max_capacity=128, bucket_size=16, score_strategy=ScorePolicy.LFU,
                               admission=FrequencyAdmission(threshold=2, counter_capacity=256)),
}


@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("build", [_sequence, _bags], ids=["sequence", "pooled"])
def test_training_equals_an_hbm_direct_twin_bit_for_bit(build, twin, backend):
    backend, device = backend
    host, direct = (build(backend, device, budget, **TWINS[twin]) for budget in (0, None))
    assert host.storage_modes()["t"] is StorageMode.HOST_ONLY
    assert direct.storage_modes()["t"] is StorageMode.HBM_DIRECT
    kjts = _batches(12, device)
    for a, b in zip(_train(host, kjts), _train(direct, kjts)):
        assert torch.equal(a, b)
    ids = torch.arange(0, 400).to(device) * 7919 - 500
    (rows_a, found_a), (rows_b, found_b) = (m.read_rows("t", ids, with_state=True)
                                            for m in (host, direct))
    assert torch.equal(found_a, found_b) and bool(found_a.any())
    assert torch.equal(rows_a, rows_b)
    host.eval(), direct.eval()
    with torch.no_grad():  # eval: found rows and the eval initializer's zeros
        assert torch.equal(_values(host(kjts[0])), _values(direct(kjts[0])))
    counted = ("lookups", "hits", "misses", "inserts", "evictions", "admission_rejects")
    stats_a, stats_b = host.stats()["t"], direct.stats()["t"]
    assert {k: stats_a[k] for k in counted} == {k: stats_b[k] for k in counted}
    assert stats_a["rows_backing"] == stats_b["rows_device"]

