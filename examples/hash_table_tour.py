"""A guided tour of the scored hash table: insert, evict by score, pin, grow, export.

Run: ``python examples/hash_table_tour.py`` (add ``--backend cuda`` on a GPU machine).
"""
import argparse

import torch

from dynemb import Initializer, ScorePolicy, TableFullError
from dynemb.rows.flat_table import FlatTable
from dynemb.rows.hash_table import ScoredHashTable


def main(backend: str = "cpu") -> None:
    device = "cuda" if backend == "cuda" and torch.cuda.is_available() else "cpu"
    ids = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731

    # One bucket of 4 slots: every key competes for the same slots.
    table = ScoredHashTable(4, policy=ScorePolicy.LRU, device=device, backend=backend)
    flat = FlatTable(table.capacity, dim=3, device=device, backend=backend)
    init = Initializer.truncated_normal(std=0.1)

    for step, batch in enumerate([[10, 11], [12, 10], [13], [14, 14, 10]], start=1):
        res = table.find_or_insert(ids(batch))
        flat.initialize(res.slots[res.inserted], res.keys[res.inserted], init, seed=0,
                        table_id=0)
        print(f"step {step}: batch {batch} -> unique {res.keys.tolist()}, "
              f"slots {res.slots.tolist()}, inserted {res.inserted.tolist()}, "
              f"evicted {res.previous_keys[res.evicted].tolist()}")

    live = table.export()
    print("live keys and LRU scores:", dict(zip(live.keys.tolist(), live.scores.tolist())))

    table.pin(table.find(ids([10, 12, 13, 14])))
    try:
        table.find_or_insert(ids([99]))
    except TableFullError as err:
        print("every slot pinned ->", type(err).__name__, "for keys", err.failed_keys.tolist())
    table.unpin(table.find(ids([10, 12, 13, 14])))

    before = flat.gather(table.find(ids([10])))
    remap = table.grow(8)
    flat.remap(remap, 8)
    after = flat.gather(table.find(ids([10])))
    print(f"grew to {table.capacity} slots; key 10's row moved with it: "
          f"{torch.equal(before, after)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    main(parser.parse_args().backend)
