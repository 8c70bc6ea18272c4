#!/usr/bin/python3
"""Reference for accel's CommHook::Fp16 (tests/unit/comm/comm_hooks.cpp):
PyTorch's own DDP with fp16_compress_hook, 2 Gloo processes, 5 SGD steps of
a small MLP. Writes tests/baselines/fp16_compress_hook.safetensors holding
the data, the initial parameters and the parameters after 5 steps.

Run with Debian's python3-torch: /usr/bin/python3 gen_comm_hook_reference.py
"""
import json
import os
import struct
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, PER_RANK, WORLD = 5, 8, 2
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp16_compress_hook.safetensors")


def make():
    torch.manual_seed(0)
    x = torch.randn(STEPS * PER_RANK * WORLD, 12)
    y = torch.randn(STEPS * PER_RANK * WORLD, 3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    return x, y, model


def names(model):
    return [n for n, _ in model.named_parameters()]


def worker(rank, port, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    x, y, model = make()
    ddp = DDP(model)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(STEPS):
        rows = slice(s * PER_RANK * WORLD + rank * PER_RANK, s * PER_RANK * WORLD + (rank + 1) * PER_RANK)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
        opt.step()
    if rank == 0:
        queue.put({n: p.detach().numpy().copy() for n, p in model.named_parameters()})  # by value
    dist.barrier()
    dist.destroy_process_group()


def save_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    final = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            sys.exit(f"worker exited with {p.exitcode}")
    x, y, model = make()
    tensors = {"x": x, "y": y}
    for n, p in model.named_parameters():
        tensors["init." + n] = p.detach()
        tensors["final." + n] = torch.from_numpy(final[n])
    save_safetensors(OUT, tensors)
    print("wrote", OUT, "torch", torch.__version__)


if __name__ == "__main__":
    main()
