"""float32 -> float16 / bfloat16 rounding on bit patterns, shared by ``round_cpu.py`` and
``round_cuda.py``.

Inputs are float32 bit patterns (int32) and outputs 16-bit patterns (int16): bfloat16 has no
numpy dtype, and integer arithmetic means both backends round identically. Stochastic
rounding rounds up with probability ``remainder / spacing``, so its mean is the input value
(unbiased); round-to-nearest-even matches torch's ``Tensor.to(dtype)``, NaN included.
"""
import numpy as np
from numba import njit

FMT_FLOAT16 = 0
FMT_BFLOAT16 = 1

_MASK32 = np.int64(0xFFFFFFFF)
_ABS = np.int64(0x7FFFFFFF)
_F32_INF = np.int64(0x7F800000)
#: 65536.0, the float16 step after 65504: at or above it every rounding gives inf.
_F16_OVERFLOW = np.int64(0x47800000)
#: Smallest float32 exponent field of a normal float16 (2^-14).
_F16_MIN_NORMAL_EXP = 113
#: Shifts past this drop every bit of a float32 mantissa and of 32 random bits.
_MAX_SHIFT = 56


@njit(cache=True, inline="always")
def _signed16(bits):
    """A 16-bit pattern as the int16 value holding it."""
    return bits - 0x10000 if bits >= 0x8000 else bits


@njit(cache=True, inline="always")
def _round_up(base, shift, rand, stochastic):
    """(``base >> shift``, 1 to round it up or 0). Stochastic: up with probability
    ``remainder / 2^shift`` from the 32 bits ``rand``; else to nearest, ties to even."""
    kept = base >> shift
    rem = base - (kept << shift)
    if stochastic:
        if shift <= 32:
            return kept, 1 if (rand >> (32 - shift)) < rem else 0
        return kept, 1 if rand < (rem >> (shift - 32)) else 0
    half = np.int64(1) << (shift - 1)
    return kept, 1 if rem > half or (rem == half and (kept & 1) == 1) else 0


@njit(cache=True, inline="always")
def round_bits(x, rand, fmt, stochastic):
    """Round the float32 with bits ``x`` (int32) to float16 (``fmt`` 0) or bfloat16 (1).

    ``rand``: 32 random bits in ``[0, 2^32)`` (unused unless ``stochastic``). Returns the
    result's 16 bits as an int16 value. NaN stays NaN, inf stays inf; finite values beyond
    the format's range round to inf (float16: from 65520 to nearest, with probability
    ``(|x| - 65504) / 32`` stochastically, and always from 65536).
    """
    bits = np.int64(x) & _MASK32
    sign = (bits >> 16) & 0x8000
    a = bits & _ABS
    if fmt == FMT_BFLOAT16:
        if a > _F32_INF:
            return _signed16(0x7FC0)
        kept, up = _round_up(a, 16, rand, stochastic)
        return _signed16(sign | (kept + up))
    if a > _F32_INF:
        return _signed16(sign | 0x7E00)
    if a >= _F16_OVERFLOW:
        return _signed16(sign | 0x7C00)
    exponent = a >> 23
    if exponent >= _F16_MIN_NORMAL_EXP:
        # Re-bias the exponent in place: the float16 bits are then the top bits of ``base``
        # and a carry out of the mantissa bumps the exponent, as it should.
        base = a - ((_F16_MIN_NORMAL_EXP - 1) << 23)
        shift = 13
    else:
        # float16 subnormal: a count of 2^-24 steps; float32 subnormals have exponent 1.
        base = a & 0x7FFFFF
        if exponent > 0:
            base = base | 0x800000
        else:
            exponent = 1
        shift = 126 - exponent
        if shift >= _MAX_SHIFT:
            return _signed16(sign)
    kept, up = _round_up(base, shift, rand, stochastic)
    return _signed16(sign | (kept + up))
