"""DDP, FSDP and tensor parallelism across 2 processes holding 2 devices each
(``--devices-per-proc 2``, the layout of torch's DDP tutorial's model-parallel part),
against one-device training on the whole batch. Tensor parallelism runs with its "tp"
groups inside each process and across the processes. Prints ``CHECK <name> ok``; a
mismatch raises."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _arrays
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ddp"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fsdp"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tensor_parallel"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tensor_parallel" / "workers"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _arrays import allclose  # noqa: E402
from _ddp_models import MLP, Reference, loss_fn, make_batches  # noqa: E402
from _fsdp_models import Block, Net  # noqa: E402
from _fsdp_models import Reference as FsdpReference  # noqa: E402
from _fsdp_models import loss_fn as fsdp_loss  # noqa: E402
from _fsdp_models import make_batches as fsdp_batches  # noqa: E402
from tp_worker import ddp_sequence_parallel_block  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402
from jaxpg.fsdp import FullyShardedDataParallel  # noqa: E402


def check(name, cond):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def close(a, b, tol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol) for x, y in zip(la, lb))


jaxpg.init_process_group()
proc, n = jax.process_index(), jaxpg.get_world_size()
assert n == 4 and jax.local_device_count() == 2, (n, jax.local_device_count())
mine = lambda b, rows: jax.tree.map(lambda x: x[proc * rows:(proc + 1) * rows], b)  # noqa: E731

opt = optax.sgd(0.1, momentum=0.9)
ddp = DistributedDataParallel(MLP(seed=proc), opt)  # rank 0's initial values win
ref = Reference(MLP(seed=0), opt)
for b in make_batches(2, 8):
    ddp.train_step(loss_fn, mine(b, 4))
    ref.step(b)
check("ddp_equals_reference", close(ddp.params, ref.params))

fopt = optax.adam(1e-2)
fsdp = FullyShardedDataParallel(Net(0), fopt, units=Block)
fref = FsdpReference(Net(0), fopt)
for b in fsdp_batches(2, 8):
    fsdp.train_step(fsdp_loss, mine(b, 4))
    fref.step(b)
check("fsdp_equals_reference", close(fsdp.full_params(), fref.params))

# DDP over "dp" of a sequence-parallel block over "tp": tp inside each process (dp across
# the processes), then tp across the processes (each process holds both dp ranks)
ddp_sequence_parallel_block(jaxpg.init_device_mesh((2, 2), ("dp", "tp")), "tp_in_process")
ddp_sequence_parallel_block(jaxpg.init_device_mesh((2, 2), ("tp", "dp")), "tp_across_processes")
print("DONE", flush=True)
