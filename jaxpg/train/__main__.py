"""``python -m jaxpg.train CONFIG.toml [--cpu-devices N] [--steps N]``."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Parses the command line, trains, prints the last losses; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m jaxpg.train", description=__doc__)
    parser.add_argument("config", help="the TOML config")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="simulate N CPU devices in this one process")
    parser.add_argument("--steps", type=int, default=None, help="override the step count")
    args = parser.parse_args(argv)
    if args.cpu_devices is not None:
        if args.cpu_devices < 1:
            parser.error(f"--cpu-devices={args.cpu_devices} must be >= 1")
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={args.cpu_devices}").strip()
    import dataclasses

    from jaxpg.groups.world import init_process_group, is_initialized
    from jaxpg.train import load_config, train

    cfg = load_config(args.config)
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if not is_initialized():
        init_process_group()
    records = train(cfg)
    last = [r for r in records if r["kind"] == "train"][-1:]
    if last:
        print(f"step {last[0]['step']}: loss {last[0]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
