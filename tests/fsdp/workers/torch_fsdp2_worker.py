"""jaxpg FSDP against torch FSDP2 (``fully_shard`` per layer plus the root, gloo) in the
same 2 processes: same weights, same data, 6 SGD steps with momentum (linear in the gradient,
so a wrong gradient average shows). Prints ``CHECK <name> ok``.

argv: the port of torch's ``tcp://127.0.0.1`` rendezvous.
"""

import sys

import jax
import numpy as np
import optax
import torch
import torch.distributed as dist
from flax import nnx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import jaxpg
from jaxpg.fsdp import FullyShardedDataParallel

SIZES = (7, 13, 9, 5)  # odd sizes: torch shards them unevenly, jaxpg pads
PER_RANK, STEPS, LR = 4, 6, 0.1


class Mlp(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def check(name, cond=True, detail=""):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}: {detail}")
    print(f"CHECK {name} ok {detail}", flush=True)


def main(port):
    jaxpg.init_process_group()
    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    model = Mlp()
    # torch's model with the same weights (torch's Linear.weight is the kernel transposed)
    layers = []
    for layer in model.layers:
        lin = torch.nn.Linear(*layer.kernel.shape)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.asarray(layer.kernel[...]).T.copy()))
            lin.bias.copy_(torch.from_numpy(np.asarray(layer.bias[...])))
        layers += [lin, torch.nn.ReLU()]
    tmodel = torch.nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (n,))
    for lin in tmodel[::2]:
        fully_shard(lin, mesh=mesh)
    fully_shard(tmodel, mesh=mesh)
    topt = torch.optim.SGD(tmodel.parameters(), lr=LR, momentum=0.9)

    fsdp = FullyShardedDataParallel(model, optax.sgd(LR, momentum=0.9), units=nnx.Linear)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        x = rng.standard_normal((PER_RANK * n, SIZES[0])).astype(np.float32)
        y = rng.integers(0, SIZES[-1], PER_RANK * n).astype(np.int64)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        fsdp.train_step(loss_fn, {"x": x[mine], "y": y[mine].astype(np.int32)})
        topt.zero_grad()
        logits = tmodel(torch.from_numpy(x[mine]))
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(y[mine])).backward()
        topt.step()

    full = fsdp.full_params()
    worst = 0.0
    for i, lin in enumerate(tmodel[::2]):
        weight = lin.weight.full_tensor().detach().numpy()  # a collective: every rank
        bias = lin.bias.full_tensor().detach().numpy()
        worst = max(worst,
                    float(np.abs(np.asarray(full["layers"][i]["kernel"]) - weight.T).max()),
                    float(np.abs(np.asarray(full["layers"][i]["bias"]) - bias).max()))
    check("equal_to_torch_fsdp2", worst < 1e-5, f"max_abs_diff={worst:.2e}")
    dist.barrier()
    dist.destroy_process_group()
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
