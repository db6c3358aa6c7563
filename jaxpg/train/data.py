"""Synthetic token data for the recipe: seeded sequences, split by ``DistributedSampler``.

Each sequence follows a fixed random successor table with noise (the next token is
``successor[token]`` with probability 0.9, else uniform), so that the loss has something
to learn. A step's global batch is the concatenation, in data-parallel rank order, of each
rank's ``global_batch / dp`` sequences from its sampler; the sampler is re-seeded per epoch
from ``seed + epoch``, so a step's batch is a function of the step alone (resuming needs
only the step).
"""

from __future__ import annotations

import numpy as np

from jaxpg.ddp.sampler import DistributedSampler

__all__ = ["synthetic_sequences", "StepBatches", "EVAL_SEED_OFFSET"]

EVAL_SEED_OFFSET = 1_000_003
"""The held-out sequences' seed is ``data.seed`` plus this."""


def synthetic_sequences(count: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """``count`` int32 sequences of ``length`` tokens from the seeded successor chain."""
    rng = np.random.default_rng(seed)
    successor = np.random.default_rng(0x5EED).permutation(vocab)
    out = np.empty((count, length), np.int32)
    out[:, 0] = rng.integers(0, vocab, count)
    noise = rng.random((count, length)) < 0.1
    uniform = rng.integers(0, vocab, (count, length))
    for t in range(1, length):
        out[:, t] = np.where(noise[:, t], uniform[:, t], successor[out[:, t - 1]])
    return out


class StepBatches:
    """The batches of every step: ``batch(step)`` for the ranks ``ranks`` of ``dp``.

    Args:
        sequences: ``(count, seq_len + 1)`` tokens.
        global_batch: sequences per step over all data-parallel ranks.
        dp: the data-parallel degree (ranks that see different sequences).
        ranks: the data-parallel ranks whose sequences this process feeds, in order.
        seed: the shuffle seed.
        shuffle: permute per epoch (False: in order, as for eval).
    """

    def __init__(self, sequences: np.ndarray, *, global_batch: int, dp: int,
                 ranks: list[int], seed: int, shuffle: bool = True) -> None:
        if global_batch % dp:
            raise ValueError(f"jaxpg.train: data.global_batch={global_batch} must be a "
                             f"multiple of the data-parallel degree {dp}.")
        self.sequences, self.local = sequences, global_batch // dp
        self.samplers = [DistributedSampler(len(sequences), num_replicas=dp, rank=r,
                                            shuffle=shuffle, seed=seed, drop_last=True)
                         for r in ranks]
        self.steps_per_epoch = len(self.samplers[0]) // self.local
        if self.steps_per_epoch < 1:
            raise ValueError(f"jaxpg.train: {len(sequences)} sequences over {dp} ranks give "
                             f"fewer than {self.local} per rank; raise data.num_sequences.")

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The ``{"tokens", "targets", "positions"}`` of ``step`` (0-based)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        rows = []
        for sampler in self.samplers:
            sampler.set_epoch(epoch)
            order = list(sampler)
            rows.extend(order[index * self.local:(index + 1) * self.local])
        window = self.sequences[np.asarray(rows)]
        seq = window.shape[1] - 1
        positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (len(rows), seq))
        return {"tokens": window[:, :-1], "targets": window[:, 1:],
                "positions": np.ascontiguousarray(positions)}
