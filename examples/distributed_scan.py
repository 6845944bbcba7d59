"""A scan over a sequence sharded across 2 processes (gloo, CPU), checked against one process.

Each rank holds a piece of a long sequence along dim 0 (uneven pieces are fine)
and gets back its piece of the scan of the whole sequence, with gradients.
Run it as ``python examples/distributed_scan.py``; with ``torchrun`` the body of
``run`` is what each rank executes (see docs/distributed.md).
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fscan
import fscan.distributed

WORLD = 2
LENGTHS = [5, 3]  # rank 0 holds steps 0..4, rank 1 steps 5..7


def combine(x, y):  # h -> a h + b, composed: the linear recurrence as a scan
    return x[0] * y[0], y[0] * x[1] + y[1]


def run(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # the same whole sequence on every rank, for the check
    a, b = torch.rand(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    start = sum(LENGTHS[:rank])
    mine = slice(start, start + LENGTHS[rank])
    a_mine, b_mine = a[mine].clone(), b[mine].clone().requires_grad_()

    # 1. this rank's piece of the scan of the whole sequence: one all_gather of
    #    one element per rank, whatever the length
    _, h = fscan.distributed.associative_scan(combine, (a_mine, b_mine), 0)
    h.pow(2).sum().backward()  # every rank runs backward (one reduce_scatter)

    _, h_whole = fscan.associative_scan(combine, (a, b.requires_grad_()), 0)
    h_whole.pow(2).sum().backward()
    assert torch.allclose(h, h_whole[mine].detach())
    assert torch.allclose(b_mine.grad, b.grad[mine])

    # 2. the same recurrence with fscan.linear_recurrence's sharded twin
    h2 = fscan.distributed.linear_recurrence(a_mine, b_mine.detach(), 0)
    assert torch.allclose(h2, h_whole[mine].detach())

    # 3. DTensors sharded along the scan dimension: the ordinary functions take them
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    da, db = (distribute_tensor(t.detach(), mesh, [Shard(0)]) for t in (a, b))
    dh = fscan.linear_recurrence(da, db, 0)
    assert dh.placements == (Shard(0),) and dh.shape == b.shape
    assert torch.allclose(dh.full_tensor(), h_whole.detach())
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(run, args=(free_port,), nprocs=WORLD)
    print("ok")
