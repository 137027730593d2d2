"""The kernel protocol (:mod:`dynemb.backends.protocol`) and its CPU and CUDA
implementations, the only code that launches :mod:`dynemb.kernels`."""
from dynemb.foundations.moved_modules import moved_name


def __getattr__(name: str):
    """Names of the single module this package was before (in old pickles)."""
    return moved_name(__name__, name)
