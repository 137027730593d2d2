"""One side of a paired before/after measurement (``ab_pair.py``): builds a
``DynamicEmbCollection`` from the dynemb on ``PYTHONPATH`` (its own checkout), then times one
step per command read from stdin ("step i": prefetch, forward, backward with the fused SGD
update; "eval i": an eval forward), replying "prefetch forward backward probe" (ms, and a sum
of some output rows that both sides must agree on).

Arguments: mode (collection: bench_collection's workload, one table, 4,096 x 20 Zipf(1.05) ids
of 1e8, dim 128; cache: the same in CACHE mode, 10% of the ids' rows on the device; tables /
eval: bench_tables' workload, 65,536 Zipf ids a step over T tables of 4 x their ids' rows,
dim 32, HBM_DIRECT holding every id; default: the same in DEFAULT mode, a device tier of
about one step's distinct ids), T, threads (numba and torch; the process is pinned to that
many cores, the same for both sides). ``AB_STEPS``: batches to make."""
import sys, time, os
import numpy as np, torch
import numba
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    OptimizerType, StorageMode)

mode, T, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, set(range(threads)))  # both sides of a pair on the same cores
os.environ["DYNEMB_THREADS"] = "off"
numba.set_num_threads(threads); torch.set_num_threads(threads)
if mode in ("collection", "cache"):
    ids, dim, length = 4096 * 20, 128, 20
else:
    ids, dim, length = 65536, 32, None
steps = int(os.environ.get('AB_STEPS', '40'))
rng = np.random.default_rng(1234 + T)
per = ids // T
vocab = 4 * per if mode not in ("collection", "cache") else 10**8
def zipf(n, hi):
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        x = rng.zipf(1.05, 2 * n); out = np.concatenate([out, x[x <= hi]])
    return out[:n] - 1
perm_salt = 0x9E3779B97F4A7C15
batches = []
for s in range(steps):
    parts = [((zipf(per, vocab) * 2654435761 + t * 1000003) % (2**62)).astype(np.int64) for t in range(T)]
    batches.append(torch.from_numpy(np.concatenate(parts)))
distinct = np.unique(np.concatenate([b.numpy() for b in batches]))
feats = [f"f{t}" for t in range(T)]
bucket = DynamicEmbTableOptions().bucket_size
per_table_distinct = max(len(distinct) // T, 1)
fit = int(np.ceil(2 * per_table_distinct * 1.3 / bucket)) * bucket
opt = OptimizerConfig(OptimizerType.SGD, learning_rate=1e-3)
width = dim
if mode == "cache":
    rows = max(bucket, int(0.1 * len(distinct) / bucket) * bucket)
    options = DynamicEmbTableOptions(max_capacity=fit, caching=True, local_hbm_for_values=rows * width * 4)
elif mode == "default":
    small = int(np.ceil(2 * (ids // T) * 0.5 / bucket)) * bucket  # about a step's distinct ids
    options = DynamicEmbTableOptions(max_capacity=fit, local_hbm_for_values=small * width * 4)
else:
    options = DynamicEmbTableOptions(max_capacity=fit, init_capacity=fit)
cfgs = [EmbeddingConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=fit, feature_names=[feats[t]]) for t in range(T)]
ec = DynamicEmbCollection(cfgs, table_options=options, optimizer=opt)
modes = set(ec.storage_modes().values())
want = {"collection": StorageMode.HBM_DIRECT, "tables": StorageMode.HBM_DIRECT, "eval": StorageMode.HBM_DIRECT,
        "cache": StorageMode.CACHE, "default": StorageMode.DEFAULT}[mode]
assert modes == {want}, modes
samples = 256 if length is None else ids // length
lengths = torch.full((T * samples,), per // samples, dtype=torch.int64)
grad = torch.randn(ids, dim, generator=torch.Generator().manual_seed(5))
def kjt(i):
    return KeyedJaggedTensor(keys=feats, values=batches[i], lengths=lengths.clone())
def step(i):
    k = kjt(i)
    t0 = time.perf_counter(); ec.prefetch(k); t1 = time.perf_counter()
    out = ec(k); vals = [out[f].values() for f in feats]
    t2 = time.perf_counter(); torch.autograd.backward(vals, list(grad.split(per))); t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, torch.cat([v.detach()[:64] for v in vals[:4]])
def evalstep(i):
    k = kjt(i)
    ec.eval()
    with torch.no_grad():
        t0 = time.perf_counter(); out = ec(k); vals = [out[f].values() for f in feats]; t1 = time.perf_counter()
    ec.train()
    return 0.0, (t1 - t0) * 1e3, 0.0, torch.cat([v[:64] for v in vals[:4]])
print("ready", flush=True)
for line in sys.stdin:
    cmd, i = line.split(); i = int(i)
    p, f, b, probe = (step if cmd == "step" else evalstep)(i)
    print(f"{p:.4f} {f:.4f} {b:.4f} {float(probe.double().sum()):.6e}", flush=True)
