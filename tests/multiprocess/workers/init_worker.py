"""Initialises through argv[1] (env://, tcp://..., file://...), runs an all_reduce, destroys
the world, initialises again and runs another: prints RESULT lines."""

import os
import sys

import numpy as np

import jaxpg


def once(method: str, attempt: int) -> None:
    rank, world = int(os.environ["JAXPG_TEST_RANK"]), int(os.environ["JAXPG_TEST_WORLD"])
    if method == "env://":
        jaxpg.init_process_group(init_method=method)
    else:
        jaxpg.init_process_group(init_method=method, rank=rank, world_size=world)
    assert jaxpg.get_rank() == rank and jaxpg.get_world_size() == world
    out = np.asarray(jaxpg.all_reduce(np.full(2, rank + attempt, np.float32)))
    print(f"RESULT {attempt} {out.tolist()}", flush=True)
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    method = sys.argv[1]
    once(method, 0)
    if len(sys.argv) > 2:
        once(sys.argv[2], 1)
