"""The processes' machinery: JAX's coordination service, its client and its hosting, gloo's
network interface and the MPI library.

Nothing is re-exported here: ``jaxpg.runtime.mpi_library`` must be importable before
anything imports jax, so this package's ``__init__`` imports nothing.
"""
