"""The kernel protocol (:mod:`dynemb.backends.protocol`) and its CPU and CUDA
implementations, the only code that launches :mod:`dynemb.kernels`."""
