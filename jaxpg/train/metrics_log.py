"""Where the recipe's metrics go: a tqdm progress bar, a JSONL file, TensorBoard.

TensorBoard events are written through ``tensorboardX`` (the ``train`` extra), imported
only when ``metrics.tensorboard`` is on. Only process 0 writes.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

from tqdm import tqdm

__all__ = ["MetricsLog", "BAR_KEYS"]

BAR_KEYS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu")
"""The metrics the progress bar shows (every metric goes to the files)."""


class MetricsLog:
    """Writes one record per step (and per eval) to the bar, the JSONL and TensorBoard.

    Args:
        directory: where ``metrics.jsonl`` and ``tensorboard/`` go (None: no files).
        tensorboard: write TensorBoard events.
        progress: show the tqdm bar (on ``sys.stderr``).
        total: the run's last step.
        initial: the step the run starts from (after a resume).
        enabled: whether this process writes (process 0).
    """

    def __init__(self, directory: str | None, *, tensorboard: bool, progress: bool,
                 total: int, initial: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.jsonl = self.writer = self.bar = None
        if not enabled:
            return
        if directory is not None:
            root = pathlib.Path(directory)
            root.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(root / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
            if tensorboard:
                try:
                    from tensorboardX import SummaryWriter
                except ImportError:
                    raise ImportError(
                        "jaxpg.train: metrics.tensorboard = true needs tensorboardX; "
                        "install it (pip install 'jaxpg[train]') or set tensorboard = "
                        "false.") from None
                self.writer = SummaryWriter(str(root / "tensorboard"))
        if progress:
            self.bar = tqdm(total=total, initial=initial, desc="train", file=sys.stderr,
                            dynamic_ncols=True, mininterval=0)

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        """Records ``metrics`` (numbers, and strings for the files only) of ``step``."""
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, "kind": kind, **metrics}) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
            self.writer.flush()
        if self.bar is not None:
            if kind == "train":
                self.bar.set_postfix({k: f"{metrics[k]:.4g}" for k in BAR_KEYS if k in metrics},
                                     refresh=False)
                self.bar.update(1)
            else:
                text = " ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                                if isinstance(v, float))
                self.bar.write(f"step {step} {kind}: {text}", file=sys.stderr)

    def close(self) -> None:
        """Flushes and closes the files and the bar."""
        for thing in (self.bar, self.writer, self.jsonl):
            if thing is not None:
                thing.close()
