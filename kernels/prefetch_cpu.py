"""Software prefetch for the CPU kernels: start loading the cache lines of a row that a later
iteration reads, so that the misses of a gather over a large table overlap instead of coming
one after another.

``prefetch_row(array, i, width)`` asks for the cache lines of ``array[i, :width]`` (a 2-D
C-contiguous array), ``prefetch_at(array, i)`` for the line of ``array[i]`` (1-D). Neither
changes anything or faults (a prefetch is a hint, even out of bounds). Both emit LLVM's
``llvm.prefetch`` (read, keep in all cache levels).

Example (in an ``@njit`` kernel)::

    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            prefetch_row(weights, slots[i + PREFETCH_DISTANCE], dim)
        ...  # read weights[slots[i]]
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

#: Iterations ahead a kernel prefetches the row it will read: enough to cover a miss with the
#: work of a few rows, few enough that the lines are still in cache when read (4-8 measured
#: best for 256-byte rows on a 2-core AMD EPYC).
PREFETCH_DISTANCE = 4
_LINE_BYTES = 64


@intrinsic
def _prefetch_element(typingctx, array, index):
    """``llvm.prefetch`` of the address of ``array[index]`` (``index``: an integer for a 1-D
    array, a tuple of two for a 2-D one)."""
    if not isinstance(array, types.Array):
        return None
    ndim = 1 if isinstance(index, types.Integer) else len(index)
    if ndim != array.ndim:
        return None
    sig = types.void(array, index)

    def codegen(context, builder, signature, args):
        array_type, index_type = signature.args
        data = context.make_array(array_type)(context, builder, args[0])
        if isinstance(index_type, types.Integer):
            values, types_ = [args[1]], [index_type]
        else:
            values = cgutils.unpack_tuple(builder, args[1], len(index_type))
            types_ = list(index_type)
        index = [context.cast(builder, v, t, types.intp) for v, t in zip(values, types_)]
        pointer = cgutils.get_item_pointer(context, builder, array_type, data, index,
                                           wraparound=False, boundscheck=False)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read (0), high temporal locality (3), data cache (1)
        builder.call(fn, [builder.bitcast(pointer, cgutils.voidptr_t), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def prefetch_at(array, i):
    """Prefetch the cache line of ``array[i]`` (1-D)."""
    _prefetch_element(array, i)


@njit(cache=True, inline="always")
def prefetch_row(array, i, width):
    """Prefetch the cache lines of ``array[i, :width]`` (2-D, C-contiguous rows)."""
    step = max(1, _LINE_BYTES // array.itemsize)
    for column in range(0, width, step):
        _prefetch_element(array, (i, column))
    if width > 0:
        _prefetch_element(array, (i, width - 1))  # the last line when the row is not aligned
