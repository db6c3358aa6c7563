"""The data-parallel core that ``jaxpg.ddp`` and ``jaxpg.fsdp`` (and ZeRO inside a
pipeline) share, so that neither imports the other's private helpers.

* :mod:`~jaxpg.data_parallel.batch_placement`: each process's samples laid out over the
  group.
* :mod:`~jaxpg.data_parallel.local_loss`: one rank's loss from a model or a pytree.
* :mod:`~jaxpg.data_parallel.loss_check`: a loss that depends on no parameter, named on the
  first trace of its step.
* :mod:`~jaxpg.data_parallel.prng_keys`: PRNG key leaves as raw data and back.
* :mod:`~jaxpg.data_parallel.checkpoint_format`: the numbered arrays a checkpoint holds and
  the restore of a state tree from them.
* :mod:`~jaxpg.data_parallel.settle`: a constructor's placement finished before the first
  checked call.
* :mod:`~jaxpg.data_parallel.leaf_split`: how a leaf is split over the data-parallel axis.
* :mod:`~jaxpg.data_parallel.zero`: the optimizer state split over it, and its update.

Nothing is re-exported here: the public names are ``jaxpg.ddp``'s and ``jaxpg.fsdp``'s.
"""
