"""Reserved keys and score-policy codes shared by every kernel."""
import os

import numpy as np

#: Marks a slot that never held a key since the last rehash. Reserved: never stored.
EMPTY_KEY = np.int64(-(2**63))
#: Marks a slot whose key was erased; probing continues past it. Reserved: never stored.
TOMBSTONE_KEY = np.int64(-(2**63) + 1)

#: Score policies, as passed to kernels (see ``dynemb.ScorePolicy`` for their meaning).
POLICY_LRU = 0
POLICY_LFU = 1
POLICY_STEP = 2
POLICY_CUSTOMIZED = 3
POLICY_NO_EVICTION = 4
POLICY_LFU_LRU = 5

#: LFU_LRU packs a key's use count and last-use clock into its int64 score:
#: ``count << LFU_LRU_CLOCK_BITS | clock``. Both parts saturate at their largest value.
LFU_LRU_CLOCK_BITS = 40
LFU_LRU_MAX_CLOCK = (1 << LFU_LRU_CLOCK_BITS) - 1
LFU_LRU_MAX_COUNT = (1 << (63 - LFU_LRU_CLOCK_BITS)) - 1

#: Largest bucket the CUDA insert kernel can track with its two 64-bit "already claimed" masks.
MAX_BUCKET_SIZE = 128


def cuda_simulator_enabled() -> bool:
    """True when numba-cuda runs kernels in its Python simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
