"""Train a next-item recommender whose item and user embeddings live in dynamic hash tables.

The data is an embedded synthetic stream (no files, no servers): a catalog of items with raw
random 64-bit ids, Zipf-distributed popularity, and hidden clusters. A user's session draws
each next item mostly from the cluster of the previous one (sometimes jumping to another of
the user's favourite clusters, rarely to a random one), so the history says a lot about what
comes next. A fixed ``nn.Embedding`` would need those ids hashed into a range; here they go
straight into a :class:`~dynemb.DynamicEmbCollection`.

Model: the item history (a variable-length sequence feature) and the target item share one
``items`` table; a ``users`` table holds user ids. Query = MLP(mean of the history, last
history item, user); score = query . item embedding; loss = softmax over in-batch negatives
with a log-Q correction (the other examples' targets are sampled by popularity, so their
logits are lowered by log-popularity, estimated with a count sketch of the stream).

Tables, to show the storage machinery at work:

- ``items``: CACHE mode: the device holds a few thousand rows (LRU) of a host backing store
  that holds every row; evicted rows are written back, missed rows loaded. With ``--disk
  DIR`` that store is on disk (RocksDB), behind a host level of ``--host-cache-mb``.
- ``users``: HBM_DIRECT with frequency admission (threshold 2): a user gets a row on their
  second appearance; until then (forever, for the long tail of a Zipf activity) lookups read
  the initializer row and nothing is stored or trained.

Training: fused row-wise AdaGrad updates the rows inside backward, ``torch.optim.Adam`` the
MLP; ``ec.prefetch`` resolves the next batch's ids before the current forward. Every few
hundred steps the model is evaluated (eval mode, which stores nothing) on a held-out stream:
HR@10 = how often the true next item ranks in the top 10 of the whole catalog, next to a
popularity baseline (the 10 most frequent items of the training stream) and a "cluster
oracle" that ranks by the generating process's own probabilities (a ceiling).

Run: ``python examples/train_next_item.py`` (about a minute on 2 CPU cores);
``--quick`` is a seconds-long smoke run; ``--device cuda`` on a GPU machine. Writes
``<out-dir>/train_next_item.png`` (loss and HR@10 curves) and ``train_next_item.json``
(the metrics); ``main()`` returns the same metrics.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, FrequencyAdmission,
                    OptimizerConfig, OptimizerType)
from dynemb.stores.disk_levels import disk_store

OUT_DIR = Path(__file__).resolve().parent / "output"
FEATURES = ["user", "history", "target"]
TOP_K = 10
EMBEDDING_LR = 0.1    # fused row-wise AdaGrad of the tables
DENSE_LR = 2e-3       # torch.optim.Adam of the MLP


@dataclass(frozen=True)
class Config:
    """Sizes of one run: the full default and ``--quick``."""

    steps: int
    batch: int
    eval_every: int
    eval_examples: int
    items: int
    clusters: int
    users: int
    cache_rows: int
    dim: int = 32
    max_history: int = 8


FULL = Config(steps=3000, batch=256, eval_every=250, eval_examples=2000, items=20_000,
              clusters=200, users=50_000, cache_rows=4096)
QUICK = Config(steps=150, batch=128, eval_every=50, eval_examples=500, items=2000, clusters=40,
               users=5000, cache_rows=1024)


# -- data --------------------------------------------------------------------------------------
class SessionWorld:
    """The hidden process behind the stream: clusters, popularity, users' tastes.

    Items are ``n_items`` raw int64 ids in ``n_clusters`` equal clusters; item popularity is
    Zipf (exponent ``zipf``) over a random ranking. Each user has two favourite clusters and a
    Zipf activity. A session starts in a favourite cluster; each next item stays in the
    current cluster with probability ``stay``, else moves to the other favourite
    (``to_favourite``) or to a cluster drawn by popularity. Within a cluster, items are drawn
    by popularity.
    """

    def __init__(self, n_items: int, n_clusters: int, n_users: int, seed: int, *,
                 zipf: float = 1.05, stay: float = 0.8, to_favourite: float = 0.12):
        rng = np.random.default_rng(seed)
        self.item_ids = _random_ids(rng, n_items)
        self.user_ids = _random_ids(rng, n_users)
        self.stay, self.to_favourite = stay, to_favourite
        per_cluster = n_items // n_clusters
        popularity = 1.0 / np.arange(1, n_items + 1) ** zipf
        order = rng.permutation(n_items)[:per_cluster * n_clusters]
        self.members = order.reshape(n_clusters, per_cluster)            # [C, S] item indices
        weights = popularity[self.members]                               # [C, S]
        self.cluster_mass = weights.sum(1) / weights.sum()               # [C]
        self.member_cdf = np.cumsum(weights / weights.sum(1, keepdims=True), axis=1)
        self.cluster_of = np.full(n_items, -1)
        self.cluster_of[self.members] = np.arange(n_clusters)[:, None]
        self.item_prob = np.zeros((n_clusters, n_items), dtype=np.float32)  # P(item | cluster)
        self.item_prob[np.arange(n_clusters)[:, None], self.members] = (
            weights / weights.sum(1, keepdims=True))
        self.user_activity = np.cumsum(1.0 / np.arange(1, n_users + 1) ** 0.9)
        self.user_activity /= self.user_activity[-1]
        self.favourites = rng.choice(n_clusters, size=(n_users, 2), p=self.cluster_mass)

    def sample(self, n: int, max_history: int, rng: np.random.Generator) -> Dict[str, np.ndarray]:
        """``n`` examples: raw ids ``user`` [n], ``history`` [n, max_history] (the first
        ``lengths`` [n] entries of a row, oldest first) and ``target`` [n]; plus the hidden
        ``user_index``, ``last_index`` (last history item) and ``target_index`` [n]."""
        users = np.searchsorted(self.user_activity, rng.random(n))
        fav = self.favourites[users]                                     # [n, 2]
        side = rng.integers(0, 2, n)
        cluster = fav[np.arange(n), side]
        items = np.empty((n, max_history + 1), dtype=np.int64)
        for t in range(max_history + 1):
            if t:
                u = rng.random(n)
                switch = (u >= self.stay) & (u < self.stay + self.to_favourite)
                side = np.where(switch, 1 - side, side)
                cluster = np.where(switch, fav[np.arange(n), side], cluster)
                jump = u >= self.stay + self.to_favourite
                cluster = np.where(jump, rng.choice(len(self.cluster_mass), n,
                                                    p=self.cluster_mass), cluster)
            pick = (self.member_cdf[cluster] < rng.random(n)[:, None]).sum(1)
            pick = np.minimum(pick, self.members.shape[1] - 1)
            items[:, t] = self.members[cluster, pick]
        lengths = rng.integers(2, max_history + 1, n)
        # the target is the item right after the history
        target = items[np.arange(n), lengths]
        return {"user": self.user_ids[users], "history": self.item_ids[items[:, :-1]],
                "lengths": lengths, "target": self.item_ids[target], "user_index": users,
                "last_index": items[np.arange(n), lengths - 1], "target_index": target}

    def oracle_hit_rate(self, examples: Dict[str, np.ndarray], chunk: int = 500) -> float:
        """HR@10 of ranking the catalog by the process's own next-item probabilities, given
        the last item's cluster and the user's favourites (which favourite the session is on
        is averaged out): a ceiling no model of this data can beat by much."""
        jump = 1.0 - self.stay - self.to_favourite
        background = jump * self.cluster_mass.astype(np.float32) @ self.item_prob     # [N]
        hits = 0
        for start in range(0, len(examples["user"]), chunk):
            part = {k: v[start:start + chunk] for k, v in examples.items()}
            fav = self.favourites[part["user_index"]]
            favourites = self.item_prob[fav[:, 0]] + self.item_prob[fav[:, 1]]      # [n, N]
            prob = (self.stay * self.item_prob[self.cluster_of[part["last_index"]]]
                    + self.to_favourite / 2 * favourites + background)
            true = prob[np.arange(len(prob)), part["target_index"]]
            hits += int(((prob > true[:, None]).sum(1) < TOP_K).sum())
        return hits / len(examples["user"])


def _random_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` distinct raw ids spread over the int64 range (far from dynemb's reserved keys)."""
    ids = np.unique(rng.integers(-(2**62), 2**62, size=n + n // 8 + 16, dtype=np.int64))
    return rng.permutation(ids)[:n]


def to_kjt(batch: Dict[str, np.ndarray], device: torch.device,
           with_ids=FEATURES) -> KeyedJaggedTensor:
    """One KJT of every feature (user, history, target), one row per example; the features
    left out of ``with_ids`` have no ids (a collection reads every feature of its tables, as
    TorchRec's does: a query without a target still gives the target feature, empty)."""
    n = len(batch["user"])
    ones = np.ones(n, dtype=np.int64)
    hist_mask = np.arange(batch["history"].shape[1])[None, :] < batch["lengths"][:, None]
    parts = {"user": (batch["user"], ones),
             "history": (batch["history"][hist_mask], batch["lengths"]),
             "target": (batch["target"], ones)}
    none = (np.zeros(0, dtype=np.int64), np.zeros(n, dtype=np.int64))
    parts = {f: parts[f] if f in with_ids else none for f in FEATURES}
    values = np.concatenate([parts[f][0] for f in FEATURES])
    lengths = np.concatenate([parts[f][1] for f in FEATURES])
    return KeyedJaggedTensor.from_lengths_sync(
        list(FEATURES), torch.from_numpy(values).to(device), torch.from_numpy(lengths).to(device))


class CountSketch:
    """Approximate occurrence counts of raw ids in a fixed array (ids hashed to buckets); used
    for the log-Q correction of in-batch negatives and the popularity baseline."""

    def __init__(self, device: torch.device, log2_buckets: int = 22):
        self.shift = 64 - log2_buckets
        self.counts = torch.zeros(1 << log2_buckets, dtype=torch.float32, device=device)
        self.total = 0

    def _bucket(self, ids: torch.Tensor) -> torch.Tensor:
        mixed = ids * -7046029254386353131  # 0x9E3779B97F4A7C15: the high bits mix every bit
        return (mixed >> self.shift) & ((1 << (64 - self.shift)) - 1)

    def add(self, ids: torch.Tensor) -> None:
        self.counts.index_add_(0, self._bucket(ids), torch.ones_like(ids, dtype=torch.float32))
        self.total += ids.numel()

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.counts[self._bucket(ids)]


# -- model -------------------------------------------------------------------------------------
def build_collection(cfg: Config, device: torch.device, seed: int,
                     disk: Optional[Path] = None, host_cache_mb: int = 0) -> DynamicEmbCollection:
    """The two tables. ``disk``: the items table's store goes to disk there (RocksDB, the
    ``dynemb[disk]`` extra), behind a host level of ``host_cache_mb`` MiB (0: none)."""
    optimizer = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=EMBEDDING_LR)
    row_bytes = (cfg.dim + optimizer.state_dim(cfg.dim)) * 4
    tables = [
        EmbeddingConfig(name="items", embedding_dim=cfg.dim, num_embeddings=2 * cfg.items,
                        feature_names=["history", "target"]),     # one table, two features
        EmbeddingConfig(name="users", embedding_dim=cfg.dim, num_embeddings=2 * cfg.users,
                        feature_names=["user"]),
    ]
    store = None if disk is None else disk_store(disk, host_cache_bytes=host_cache_mb << 20)
    options = {
        # a device budget of cache_rows rows, well below the catalog: CACHE over a host store
        "items": DynamicEmbTableOptions(caching=True, local_hbm_for_values=cfg.cache_rows *
                                        row_bytes, seed=seed, backing_store=store),
        "users": DynamicEmbTableOptions(admission=FrequencyAdmission(threshold=2), seed=seed),
    }
    return DynamicEmbCollection(tables, device, table_options=options, optimizer=optimizer)


class NextItemModel(torch.nn.Module):
    """Query tower over (history, user) and item embeddings from one DynamicEmbCollection."""

    def __init__(self, ec: DynamicEmbCollection, dim: int, hidden: int = 128):
        super().__init__()
        self.ec = ec
        self.tower = torch.nn.Sequential(
            torch.nn.Linear(3 * dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim))

    def forward(self, kjt: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        """``query`` [B, dim] and ``target`` [B, dim] (empty when the KJT's target feature
        has no ids)."""
        emb = self.ec(kjt)
        hist = emb["history"]
        lengths = hist.lengths()
        batch = lengths.numel()
        segment = torch.repeat_interleave(torch.arange(batch, device=lengths.device), lengths)
        mean = torch.zeros(batch, hist.values().shape[1], device=lengths.device)
        mean = mean.index_add(0, segment, hist.values()) / lengths.clamp(min=1)[:, None]
        last = hist.values()[torch.cumsum(lengths, 0) - 1]
        out = {"query": self.tower(torch.cat([mean, last, emb["user"].values()], dim=1))}
        out["target"] = emb["target"].values()
        return out


def in_batch_loss(query: torch.Tensor, target: torch.Tensor, target_ids: torch.Tensor,
                  log_q: torch.Tensor) -> torch.Tensor:
    """Softmax cross-entropy of each query over the batch's targets, logits minus log-Q;
    other examples with the same target item are not counted as negatives."""
    logits = query @ target.T - log_q[None, :]                               # [B, B]
    same = target_ids[:, None] == target_ids[None, :]
    same.fill_diagonal_(False)
    logits = logits.masked_fill(same, float("-inf"))
    labels = torch.arange(query.shape[0], device=query.device)
    return torch.nn.functional.cross_entropy(logits, labels)


# -- evaluation --------------------------------------------------------------------------------
@torch.no_grad()
def hit_rate(model: NextItemModel, examples: Dict[str, np.ndarray], catalog: torch.Tensor,
             device: torch.device, chunk: int = 1000) -> float:
    """HR@10 over the whole catalog: eval-mode queries against the stored item rows.

    Items the table has never stored are no candidates (their true item counts as a miss):
    ``read_rows`` reads the rows wherever they live (device cache or backing store) and says
    which exist, without inserting or rescoring anything.
    """
    was_training = model.training
    model.eval()
    rows, stored = model.ec.read_rows("items", catalog)                      # [N, dim], [N]
    rows = rows.float()
    unstored = torch.where(stored, 0.0, float("-inf"))
    hits = 0
    for start in range(0, len(examples["user"]), chunk):
        part = {k: v[start:start + chunk] for k, v in examples.items()}
        query = model(to_kjt(part, device, with_ids=["user", "history"]))["query"]
        scores = query @ rows.T + unstored                                   # [n, N]
        truth = torch.from_numpy(part["target_index"]).to(device)
        rank = (scores > scores.gather(1, truth[:, None])).sum(1)
        hits += int(((rank < TOP_K) & stored[truth]).sum())
    model.train(was_training)
    return hits / len(examples["user"])


def popularity_hit_rate(sketch: CountSketch, examples: Dict[str, np.ndarray],
                        catalog: torch.Tensor) -> float:
    """HR@10 of recommending the 10 items most frequent in the training stream."""
    top = torch.topk(sketch[catalog], TOP_K).indices
    truth = torch.from_numpy(examples["target_index"]).to(catalog.device)
    return float(torch.isin(truth, top).float().mean())


# -- training ----------------------------------------------------------------------------------
def train(cfg: Config, device: torch.device, seed: int, out_dir: Path,
          disk: Optional[Path] = None, host_cache_mb: int = 0) -> Dict[str, object]:
    torch.manual_seed(seed)
    world = SessionWorld(cfg.items, cfg.clusters, cfg.users, seed)
    train_rng, eval_rng = np.random.default_rng(seed + 1), np.random.default_rng(seed + 2)
    held_out = world.sample(cfg.eval_examples, cfg.max_history, eval_rng)
    catalog = torch.from_numpy(world.item_ids).to(device)

    ec = build_collection(cfg, device, seed, disk, host_cache_mb)
    model = NextItemModel(ec, cfg.dim).to(device)
    dense_opt = torch.optim.Adam(model.tower.parameters(), lr=DENSE_LR)
    sketch = CountSketch(device)
    modes = ", ".join(f"{name} {mode.name}" for name, mode in ec.storage_modes().items())
    print(f"{cfg.items} items in {cfg.clusters} hidden clusters, {cfg.users} users; tables: "
          f"{modes} (items cache: {cfg.cache_rows} rows); batch {cfg.batch}, {cfg.steps} steps")

    def next_batch():
        part = world.sample(cfg.batch, cfg.max_history, train_rng)
        return part, to_kjt(part, device)

    losses: List[float] = []
    curve = [(0, hit_rate(model, held_out, catalog, device))]
    cache_rates: List[float] = []
    eval_inserts = 0
    window_start = _item_counts(ec)          # items counters when this training window began
    start = time.perf_counter()
    cur = next_batch()
    ec.prefetch(cur[1])
    eval_steps = evaluation_steps(cfg.steps, cfg.eval_every)
    last_eval = 0
    bar = tqdm(range(1, cfg.steps + 1), desc="train", mininterval=0.5, dynamic_ncols=True)
    for step in bar:
        nxt = next_batch() if step < cfg.steps else None
        evaluate = step in eval_steps
        # One batch ahead: the next batch's ids are resolved (inserted, loaded into the cache,
        # pinned) before this forward. Not before an evaluation: forward consumes the oldest
        # prefetched batch, so the eval forwards need an empty queue.
        if nxt is not None and not evaluate:
            ec.prefetch(nxt[1])
        losses.append(train_step(model, dense_opt, sketch, *cur, device))
        if evaluate:
            now = _item_counts(ec)
            hits = now["hits"] - window_start["hits"]
            cache_rates.append(hits / max(1, hits + now["misses"] - window_start["misses"]))
            curve.append((step, hit_rate(model, held_out, catalog, device)))
            window_start = _item_counts(ec)
            eval_inserts += window_start["inserts"] - now["inserts"]   # eval mode stores nothing
            tqdm.write(f"step {step:5d}  loss {np.mean(losses[last_eval:]):.3f}  "
                       f"HR@{TOP_K} {curve[-1][1]:.3f}  items cache hit rate "
                       f"{cache_rates[-1]:.3f}")
            last_eval = step
            if nxt is not None:
                ec.prefetch(nxt[1])
        bar.set_postfix(loss=f"{losses[-1]:.3f}", hr10=f"{curve[-1][1]:.3f}")
        cur = nxt
    bar.close()
    seconds = time.perf_counter() - start

    metrics = run_metrics(cfg, seconds, losses, curve, sketch, held_out, catalog, world,
                          cache_rates, eval_inserts)
    metrics["stats"] = ec.stats()
    metrics["plot"] = str(plot(metrics, out_dir / "train_next_item.png"))
    metrics["json"] = str(out_dir / "train_next_item.json")
    Path(metrics["json"]).write_text(json.dumps(metrics, indent=1))
    print_summary(metrics)
    return metrics


def run_metrics(cfg: Config, seconds: float, losses: List[float], curve, sketch, held_out,
                catalog, world, cache_rates: List[float], eval_inserts: int) -> Dict[str, object]:
    """The metrics a training run reports: loss (first vs last steps), the HR@10 curve next
    to the popularity, cluster-oracle and random baselines, cache hit rate, eval inserts."""
    window = max(1, min(100, len(losses) // 5))
    return {
        "steps": cfg.steps,
        "seconds": seconds,
        "losses": losses,
        "initial_loss": float(np.mean(losses[:window])),
        "final_loss": float(np.mean(losses[-window:])),
        "hr10": curve[-1][1],
        "hr10_curve": curve,
        "hr10_popularity": popularity_hit_rate(sketch, held_out, catalog),
        "hr10_oracle": world.oracle_hit_rate(held_out),
        "hr10_random": TOP_K / cfg.items,
        "cache_hit_rate": cache_rates[-1],
        "eval_inserts": eval_inserts,
    }


def evaluation_steps(steps: int, every: int) -> set:
    """Every ``every`` steps and the last, plus a few early ones where the curve is steep."""
    early = {every // 8, every // 4, every // 2}
    return {s for s in early | set(range(every, steps + 1, every)) | {steps} if 0 < s <= steps}


def train_step(model: NextItemModel, dense_opt: torch.optim.Optimizer, sketch: CountSketch,
               part: Dict[str, np.ndarray], kjt: KeyedJaggedTensor, device) -> float:
    target_ids = torch.from_numpy(part["target"]).to(device)
    sketch.add(target_ids)
    log_q = torch.log(sketch[target_ids] / sketch.total)
    out = model(kjt)
    loss = in_batch_loss(out["query"], out["target"], target_ids, log_q)
    dense_opt.zero_grad()
    loss.backward()       # the fused optimizer updates the embedding rows here
    dense_opt.step()
    return loss.item()


def _item_counts(ec: DynamicEmbCollection) -> Dict[str, int]:
    return ec.stats()["items"]


# -- report ------------------------------------------------------------------------------------
def print_summary(m: Dict[str, object]) -> None:
    print(f"\n{m['steps']} steps in {m['seconds']:.0f} s "
          f"({m['steps'] / m['seconds']:.1f} steps/s, evaluations included)")
    print(f"loss: {m['initial_loss']:.3f} (first steps) -> {m['final_loss']:.3f} (last steps)")
    print(f"HR@{TOP_K} on the held-out stream, whole catalog: model {m['hr10']:.3f} | "
          f"popularity {m['hr10_popularity']:.3f} | random {m['hr10_random']:.4f} | "
          f"cluster oracle {m['hr10_oracle']:.3f}")
    print(f"items cache hit rate (last training window): {m['cache_hit_rate']:.3f}; rows "
          f"inserted by evaluation: {m['eval_inserts']}")
    for name, s in m["stats"].items():
        print(f"table {name!r} ({s['storage_mode']}): {s['rows_device']} rows on device "
              f"(capacity {s['device_capacity']}), {s['rows_backing']} in the backing store; "
              f"evictions {s['evictions']}, write-backs {s['write_backs']}, loads {s['loads']}; "
              f"admission rejects {s['admission_rejects']} "
              f"({s['admission_pending']} ids still being counted)")
    print(f"plot: {m['plot']}; metrics: {m['json']}")


def plot(m: Dict[str, object], path: Path) -> Path:
    """Loss per step (and its running mean) next to held-out HR@10 and the baselines; with
    ``m["table_metrics"]`` (intervals of :class:`dynemb.metrics.DynamicTableMetrics`), each
    table's hit rate and load factor over the steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    intervals = m.get("table_metrics") or []
    fig, axes = plt.subplots(1, 3 if intervals else 2, figsize=(16.5 if intervals else 11, 4))
    ax_loss, ax_hr = axes[:2]
    if intervals:
        _plot_table_metrics(axes[2], intervals)
    losses = np.asarray(m["losses"])
    steps = np.arange(1, len(losses) + 1)
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax_loss.plot(steps, losses, alpha=0.3, label="per step")
    ax_loss.plot(steps[window - 1:], smooth, label=f"mean of {window}")
    ax_loss.set(xlabel="step", ylabel="in-batch softmax loss", title="training loss")
    ax_loss.legend()
    xs, ys = zip(*m["hr10_curve"])
    ax_hr.plot(xs, ys, marker="o", label="model")
    ax_hr.axhline(m["hr10_oracle"], color="green", linestyle=":", label="cluster oracle")
    ax_hr.axhline(m["hr10_popularity"], color="gray", linestyle="--", label="popularity")
    ax_hr.set(xlabel="step", ylabel=f"HR@{TOP_K}", ylim=(0, 1),
              title=f"held-out HR@{TOP_K} over the whole catalog")
    ax_hr.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_table_metrics(ax, intervals: List[Dict[str, float]]) -> None:
    """Each table's hit rate (solid) and load factor (dashed) per interval."""
    steps = [i["step"] for i in intervals]
    tables = sorted({k.rsplit("/", 1)[0] for k in intervals[0] if k.endswith("/hit_rate")})
    for color, table in zip(plt_colors(), tables):
        ax.plot(steps, [i[f"{table}/hit_rate"] for i in intervals], color=color,
                label=f"{table} hit rate")
        ax.plot(steps, [i[f"{table}/load_factor"] for i in intervals], color=color,
                linestyle="--", label=f"{table} load factor")
    ax.set(xlabel="step", ylim=(0, 1.05),
           title="tables per interval (summed over ranks)")
    ax.legend(loc="lower right", fontsize=8)


def plt_colors() -> List[str]:
    return ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="training steps (default 3000; quick 150)")
    parser.add_argument("--quick", action="store_true", help="small catalog, seconds-long run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR,
                        help=f"where the plot and metrics go (default {OUT_DIR})")
    parser.add_argument("--disk", type=Path,
                        help="keep the items table's store on disk in this directory "
                             "(RocksDB; docs/storage.md)")
    parser.add_argument("--host-cache-mb", type=int, default=0,
                        help="with --disk: a host-memory level of this many MiB in front of "
                             "the disk (default 0: none)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.host_cache_mb < 0 or (args.host_cache_mb and args.disk is None):
        parser.error("--host-cache-mb is a size in MiB >= 0, and goes with --disk")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (and the gpu extra installed)")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    """Train, evaluate, print the summary and save the plot; returns the metrics."""
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    device = torch.device(args.device)
    if device.type == "cpu":
        # The dense ops are tiny ([256, 128] matmuls): extra intra-op threads only add OpenMP
        # barrier waits, which stall badly on a busy 2-core machine. dynemb's numba kernels
        # keep their own threads.
        torch.set_num_threads(1)
    return train(cfg, device, args.seed, args.out_dir, args.disk, args.host_cache_mb)


if __name__ == "__main__":
    main()
