"""Serving export of a sharded pooled module on 2 spawned CPU ranks (gloo): each rank exports
its share of a row-wise sharded DynamicEmbBagCollection with ``to_static`` (a TorchRec
EmbeddingBagCollection), ``merge_exports`` joins the shares, and the merged
StaticServingBagCollection answers each rank's probe batch as the sharded module's eval
forward did (see tests/serving_pooled_worker.py). MEAN, SUM and weighted SUM tables; seen
ids of both ranks, unseen ids, mixed bags, empty bags."""
import numpy as np
import torch

from examples.spawn import run_on_ranks
from tests.sharded_bag_twin import NUM_IDS, BagScenario
from tests.serving_pooled_worker import UNSEEN, export_shares

SCENARIOS = {"mixed": BagScenario(pooling="mixed", mode="cache", optimizer="adagrad", steps=6),
             "weighted": BagScenario(pooling="weighted", mode="default", steps=6)}


def test_ranks_exports_of_a_sharded_pooled_module_merge_into_its_eval(tmp_path):
    from dynemb.serving import StaticBagExport, StaticServingBagCollection, merge_exports
    results = run_on_ranks(2, export_shares, SCENARIOS, str(tmp_path), timeout=600)
    for i, (name, scenario) in enumerate(SCENARIOS.items()):
        ranks = [per_rank[i] for per_rank in results]
        assert {r["type"] for r in ranks} == {"ShardedDynamicEmbBagCollection"}
        shares = [torch.load(tmp_path / f"{name}_rank{rank}.pt", weights_only=False)
                  for rank in range(2)]
        assert all(isinstance(s, StaticBagExport) for s in shares)
        for table in ("t0", "t1"):  # each rank exported exactly the keys it holds
            for rank, share in enumerate(shares):
                np.testing.assert_array_equal(share.remaps[table].keys.numpy(),
                                              np.sort(ranks[rank]["held"][table]))
        merged = merge_exports(shares)
        assert merged.ebc.is_weighted() == (name == "weighted")
        assert [c.pooling for c in merged.ebc.embedding_bag_configs()] == [
            c.pooling for c in shares[0].ebc.embedding_bag_configs()]
        for table in ("t0", "t1"):
            both = np.concatenate([r["held"][table] for r in ranks])
            assert len(set(both.tolist())) == both.size > 0  # disjoint shares, none empty
            np.testing.assert_array_equal(merged.remaps[table].keys.numpy(), np.sort(both))
            assert not bool(torch.isin(UNSEEN, merged.remaps[table].keys).any())
        serving = StaticServingBagCollection(*merged)
        for rank, r in enumerate(ranks):
            with torch.no_grad():
                got = serving(r["probe"])
            assert got.keys() == r["keys"]
            # the sharded module adds the ranks' partial sums: single-id bags (the first
            # NUM_IDS + 3 of each feature, all rows) are exact, multi-id bags equal up to
            # the order of the float additions
            single = NUM_IDS + UNSEEN.numel()
            np.testing.assert_array_equal(got.values()[:single].numpy(), r["values"][:single])
            np.testing.assert_allclose(got.values().numpy(), r["values"], rtol=1e-6,
                                       atol=1e-6)
            assert np.abs(r["values"]).sum() > 0
