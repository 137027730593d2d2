"""``state_dict`` / ``load_state_dict`` of DynamicEmbCollection: a model saved with
``torch.save`` and loaded into a freshly built one continues exactly as the uninterrupted
run (outputs, losses, rows, scores, counters), in every storage mode and optimizer; bad
checkpoints are refused with the model unchanged."""
import pytest
import torch

from checkpoint_files_models import assert_same_state, module_state
from checkpoint_models import (DIM, MODES, OPTIMIZERS, all_rows, batches, model, roundtrip,
                               train)
from dynemb import ScorePolicy, TableFullError
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY

STEPS_BEFORE, STEPS_AFTER = 12, 8
ALL_IDS = torch.arange(600) * 7919 - 1000


def continue_both(make, before=STEPS_BEFORE, after=STEPS_AFTER):
    """Train a model, checkpoint it, load into a fresh one; train both further."""
    kjts = batches(before + after)
    original = make()
    train(original, kjts[:before])
    state = roundtrip(original.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    return original, resumed, train(original, kjts[before:]), train(resumed, kjts[before:])


def assert_same_tables(a, b):
    for name in a.tables:
        rows_a, found_a = all_rows(a, name, ALL_IDS)
        rows_b, found_b = all_rows(b, name, ALL_IDS)
        assert torch.equal(found_a, found_b), name
        assert torch.equal(rows_a, rows_b), name
        assert a.stats()[name] == b.stats()[name]
        ta, tb = a.tables[name], b.tables[name]
        assert torch.equal(ta.tier.hash.image()[0], tb.tier.hash.image()[0])
        assert torch.equal(ta.tier.hash.image()[1], tb.tier.hash.image()[1])
        assert ta.tier.hash.clock == tb.tier.hash.clock


def assert_same_run(run_a, run_b):
    (losses_a, outs_a), (losses_b, outs_b) = run_a, run_b
    assert torch.equal(torch.stack(losses_a), torch.stack(losses_b))
    for oa, ob in zip(outs_a, outs_b):
        for f in oa:
            assert torch.equal(oa[f], ob[f])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_resumed_training_equals_the_uninterrupted_run(mode, optimizer):
    original, resumed, run_a, run_b = continue_both(lambda: model(mode, optimizer))
    assert_same_run(run_a, run_b)
    assert_same_tables(original, resumed)
    assert resumed.steps == original.steps


@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.STEP,
                                    ScorePolicy.LFU_LRU, ScorePolicy.CUSTOMIZED])
@pytest.mark.parametrize("mode", MODES)
def test_scores_and_admission_counts_survive_the_checkpoint(mode, policy):
    make = lambda: model(mode, "adam", policy=policy, admission=True)  # noqa: E731
    original, resumed, run_a, run_b = continue_both(make)
    assert_same_run(run_a, run_b)
    assert_same_tables(original, resumed)
    adm_a, adm_b = (m.tables["t0"].admission.table.image() for m in (original, resumed))
    assert torch.equal(adm_a[0], adm_b[0]) and torch.equal(adm_a[1], adm_b[1])
    assert original.stats()["t0"]["admission_rejects"] > 0


def test_cache_rows_in_the_backing_store_are_saved_and_read_back():
    original, resumed, *_ = continue_both(lambda: model("cache", "adagrad"), after=0)
    stats = original.stats()["t0"]
    assert stats["rows_backing"] > 0 and stats["write_backs"] > 0  # the store holds rows
    store_keys = original.tables["t0"].store.hash_table.image()[0]
    stored = store_keys[store_keys >= -1000]
    rows_a, found_a = original.read_rows("t0", stored, with_state=True)
    rows_b, found_b = resumed.read_rows("t0", stored, with_state=True)
    assert bool(found_a.all()) and bool(found_b.all())
    assert torch.equal(rows_a, rows_b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tables_resume_bit_for_bit(dtype):
    original, resumed, run_a, run_b = continue_both(lambda: model("default", "adam",
                                                                  dtype=dtype))
    assert_same_run(run_a, run_b)
    assert_same_tables(original, resumed)


def test_rows_pinned_by_a_queued_prefetch_are_saved_with_their_values():
    kjts = batches(6)
    original = model("cache", "sgd")
    train(original, kjts[:4])
    original.prefetch(kjts[4])  # inserts and loads kjts[4]'s rows, pinned
    state = roundtrip(original.state_dict())
    resumed = model("cache", "sgd")
    resumed.load_state_dict(state)
    assert resumed.pending_prefetches == 0
    assert_same_run(train(original, kjts[4:]), train(resumed, kjts[4:]))


def test_state_dict_holds_the_live_entries_with_their_slots():
    ec = model("hbm_direct", "sgd")
    train(ec, batches(3))
    state = ec.state_dict()
    group = "dynamic_tables.t0.rank0_of_1.device"
    keys, scores = ec.tables["t0"].tier.hash.image()
    live = ((keys != EMPTY_KEY) & (keys != TOMBSTONE_KEY)).nonzero().squeeze(1)
    assert 0 < live.numel() < keys.numel()
    assert state[f"{group}.layout"].tolist()[3:] == [live.numel(), 0]
    weights = ec.tables["t0"].tier.flat.weights
    expected = {"slots": live, "keys": keys[live], "scores": scores[live],
                "rows": weights[live]}
    saved = roundtrip(state)  # torch.save / torch.load: plain tensors of the entries
    for field, entries in expected.items():
        got = state[f"{group}.{field}"]
        assert torch.equal(got, entries) and got.data_ptr() != weights.data_ptr(), field
        assert type(saved[f"{group}.{field}"]) is torch.Tensor
        assert torch.equal(saved[f"{group}.{field}"], entries), field


def test_loading_into_a_table_of_another_dim_or_optimizer_names_it_and_changes_nothing():
    source = model("hbm_direct", "adam", dims=(DIM, 2 * DIM))
    train(source, batches(3))
    state = roundtrip(source.state_dict())
    for target, what in [(model("hbm_direct", "adam"), "dim 16 in the checkpoint, 8 here"),
                         (model("hbm_direct", "sgd", dims=(DIM, 2 * DIM)), "optimizer adam"),
                         (model("hbm_direct", "adam", dims=(DIM, 2 * DIM), admission=True),
                          r"tiers \['device'\] in the checkpoint, \['admission', 'device'\]")]:
        train(target, batches(2, seed=5))
        before = {n: all_rows(target, n, ALL_IDS) for n in target.tables}
        with pytest.raises(RuntimeError, match=what):
            target.load_state_dict(state)
        for n, (rows, found) in before.items():
            after_rows, after_found = all_rows(target, n, ALL_IDS)
            assert torch.equal(rows, after_rows) and torch.equal(found, after_found)


def test_loading_a_half_precision_checkpoint_into_float32_is_refused():
    state = roundtrip(model("hbm_direct", "sgd", dtype=torch.float16).state_dict())
    with pytest.raises(RuntimeError, match="dtype torch.float16 in the checkpoint"):
        model("hbm_direct", "sgd").load_state_dict(state)


def test_a_missing_table_is_reported_and_nothing_loads():
    state = roundtrip(model("hbm_direct", "sgd").state_dict())
    for key in [k for k in state if ".t1." in k]:
        del state[key]
    target = model("hbm_direct", "sgd")
    train(target, batches(2))
    rows_before = all_rows(target, "t0", ALL_IDS)[0]
    with pytest.raises(RuntimeError, match=r"Missing key.*dynamic_tables\.t1\.signature"):
        target.load_state_dict(state)
    assert torch.equal(rows_before, all_rows(target, "t0", ALL_IDS)[0])


def test_a_backward_of_a_forward_from_before_the_load_raises():
    ec = model("hbm_direct", "sgd")
    kjt = batches(1)[0]
    state = roundtrip(ec.state_dict())
    out = ec(kjt)
    ec.load_state_dict(state)
    with pytest.raises(RuntimeError, match="a checkpoint was loaded or tables were reset after this forward"):
        sum(jt.values().sum() for jt in out.values()).backward()


def test_a_checkpoint_of_a_grown_table_loads_into_a_fresh_smaller_one_exactly():
    # HBM_DIRECT starts at 64 rows and grows; the fresh model has 64: it grows to the saved
    # capacity and takes every key at its saved slot
    original = model("hbm_direct", "sgd")
    train(original, batches(10))
    assert original.tables["t0"].tier.hash.capacity > 64
    resumed = model("hbm_direct", "sgd")
    resumed.load_state_dict(roundtrip(original.state_dict()))
    assert_same_tables(original, resumed)


def _with_bucket(mode, bucket, **kwargs):
    ec = model(mode, "adagrad", **kwargs)
    return ec if bucket is None else _rebuild(ec, bucket)


def _rebuild(ec, bucket):
    import dataclasses

    from dynemb import DynamicEmbCollection
    options = {n: dataclasses.replace(o, bucket_size=bucket)
               for n, o in ec.table_options.items()}
    return DynamicEmbCollection(ec.embedding_configs(), table_options=options,
                                optimizer=ec.optimizer_config)


@pytest.mark.parametrize("mode", MODES)
def test_another_layout_loads_by_key_with_every_row_and_score(mode):
    original = model(mode, "adagrad", policy=ScorePolicy.LFU)
    train(original, batches(10))
    target = _rebuild(model(mode, "adagrad", policy=ScorePolicy.LFU), 64)  # other buckets
    target.load_state_dict(roundtrip(original.state_dict()))
    for name in original.tables:
        rows_a, found_a = all_rows(original, name, ALL_IDS)
        rows_b, found_b = all_rows(target, name, ALL_IDS)
        assert torch.equal(found_a, found_b) and torch.equal(rows_a, rows_b)
    assert original.stats()["t0"]["lookups"] == target.stats()["t0"]["lookups"]
    if mode != "cache":  # CACHE loads by key into its store, where scores are kept too
        a, b = original.tables["t0"].tier.hash, target.tables["t0"].tier.hash
        keys = ALL_IDS[all_rows(original, "t0", ALL_IDS)[1]]
        in_a, in_b = a.find(keys), b.find(keys)
        both = (in_a >= 0) & (in_b >= 0)
        assert torch.equal(a.scores_at(in_a[both]), b.scores_at(in_b[both]))
    # and it trains on as the original does
    assert_same_run(train(original, batches(4, seed=9)), train(target, batches(4, seed=9)))


def test_a_checkpoint_too_big_for_the_table_fails_by_name_and_changes_nothing():
    import dataclasses

    from dynemb import DynamicEmbCollection
    original = model("hbm_direct", "sgd")
    train(original, batches(10))
    small = {n: dataclasses.replace(o, init_capacity=64, max_capacity=64)
             for n, o in original.table_options.items()}
    target = DynamicEmbCollection(original.embedding_configs(), table_options=small,
                                  optimizer=original.optimizer_config)
    train(target, batches(1, seed=4))
    before = all_rows(target, "t0", ALL_IDS)
    with pytest.raises(TableFullError, match="table 't0'.*found no free slot"):
        target.load_state_dict(roundtrip(original.state_dict()))
    after = all_rows(target, "t0", ALL_IDS)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_a_grown_backing_store_comes_back_slot_for_slot():
    # 5,000 distinct ids through a 128-row cache: the store grows past its first 4,096 slots
    def make():
        import dataclasses

        from dynemb import DynamicEmbCollection
        ec = model("cache", "sgd", dims=(DIM,))
        config = dataclasses.replace(ec.embedding_configs()[0], num_embeddings=8192)
        return DynamicEmbCollection([config], table_options=ec.table_options,
                                    optimizer=ec.optimizer_config)
    original = make()
    ids = torch.arange(5000) * 31 + 7
    for chunk in ids.split(50):
        original(_kjt(chunk))["f0"].values().sum().backward()
    store = original.tables["t0"].store
    assert store.capacity > 4096
    resumed = make()
    resumed.load_state_dict(roundtrip(original.state_dict()))
    assert resumed.tables["t0"].store.capacity == store.capacity
    for a, b in zip(store.hash_table.image(), resumed.tables["t0"].store.hash_table.image()):
        assert torch.equal(a, b)
    assert torch.equal(original.read_rows("t0", ids)[0], resumed.read_rows("t0", ids)[0])


def _kjt(ids):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    return KeyedJaggedTensor.from_lengths_sync(["f0"], ids, torch.ones_like(ids))


# -- images edited by hand ------------------------------------------------------------------------
def _edited_image(how):
    """A checkpoint of a trained module whose t0 device entries were edited: a key ``moved`` to
    an empty slot of another bucket, or written ``twice`` (the copy where its probe reaches
    it), two entries in one slot (``same_slot``), a slot past the capacity (``outside``), or a
    negative ``counter``."""
    source = model("hbm_direct", "sgd")
    train(source, batches(6))
    state = roundtrip(source.state_dict())
    group = "dynamic_tables.t0.rank0_of_1"
    keys, slots = state[f"{group}.device.keys"], state[f"{group}.device.slots"]
    layout = state[f"{group}.device.layout"]
    capacity, bucket = layout.tolist()[:2]
    image = torch.full((capacity,), EMPTY_KEY)
    image[slots] = keys
    image[state[f"{group}.device.tombstones"]] = TOMBSTONE_KEY
    slot = int(slots[0])
    base = slot - slot % bucket
    if how == "moved":
        empty = (image == EMPTY_KEY) & (torch.arange(capacity) // bucket != slot // bucket)
        slots[0] = int(empty.nonzero()[0])
    elif how in ("twice", "same_slot"):
        pos = slot % bucket
        while int(image[base + pos]) != EMPTY_KEY:  # on along its probe to an empty slot
            pos = (pos + 1) % bucket
        copy = dict(keys=keys[:1], scores=state[f"{group}.device.scores"][:1],
                    slots=torch.tensor([base + pos if how == "twice" else slot]),
                    rows=state[f"{group}.device.rows"][:1])
        if how == "same_slot":
            copy["keys"] = torch.tensor([12345678])
        for field, value in copy.items():
            name = f"{group}.device.{field}"
            state[name] = torch.cat([state[name], value])
        layout[3] += 1
    elif how == "outside":
        slots[0] = capacity
    else:
        state[f"{group}.state"][1] = -5  # lookups
    return state


@pytest.mark.parametrize("how, message", [
    ("moved", r"table 't0', tier 'device'.*outside their bucket"),
    ("twice", r"table 't0', tier 'device'.*stored twice"),
    ("same_slot", r"table 't0', tier 'device'.*1 slots are given twice"),
    ("outside", r"table 't0', tier 'device'.*slots outside \[0, "),
    ("counter", r"table 't0'.*negative counters")])
def test_an_image_with_a_key_out_of_place_or_twice_is_refused_and_nothing_changes(how, message):
    state = _edited_image(how)
    target = model("hbm_direct", "sgd")
    train(target, batches(2, seed=5))
    before = module_state(target)
    with pytest.raises(RuntimeError, match=message):
        target.load_state_dict(state)
    assert_same_state(module_state(target), before)


def test_a_score_policy_mismatch_names_the_policies():
    state = roundtrip(model("hbm_direct", "sgd", policy=ScorePolicy.LFU).state_dict())
    with pytest.raises(RuntimeError, match="score policy LFU in the checkpoint, LRU here"):
        model("hbm_direct", "sgd").load_state_dict(state)
