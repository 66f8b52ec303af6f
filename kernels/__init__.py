"""Triton kernel families (one per module) with typed launchers, and the CUDA C++ ones of csrc/.

The package imports nothing: kernels.csrc (the extensions' cache, standard library only) is read
by the client, which must never import torch; what the launchers share is in kernels.launch.
"""
