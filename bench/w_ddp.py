#!/usr/bin/python3
"""Workload W (shared/WORKLOAD.md) on 2 processes through PyTorch's own Python
DistributedDataParallel with the gloo backend: the baseline of bench/w_ddp.cpp.

    /usr/bin/python3 bench/w_ddp.py [--port 29611] [--hook fp16|bf16|powersgd]
    RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. /usr/bin/python3 bench/w_ddp.py --env [--hook ...]
        (one process per machine: bench/comm_hooks_net.sh)

Run with Debian's /usr/bin/python3 (python3-torch 1.13, the same LibTorch as
accel). Two processes (torch.multiprocessing, fork), one intra-op thread each,
DDP defaults (bucket_cap_mb 25, gradients overlapped with backward). Step i,
rank r: rows [64b + 32r, 64b + 32r + 32), b = i % 100. Timing as in
WORKLOAD.md: 3 warm-up steps, 3 windows of 10 steps, a barrier before and
after each window, the slowest rank's window time. Rank 0 prints
    RESULT python_ddp_gloo <min> <median> <loss0> <loss32> <gate> - - <w1> <w2> <w3>
in the format of w_ddp.cpp (losses: mean over ranks). With --hook, DDP's
fp16_compress_hook, bf16_compress_hook or powerSGD_hook (rank 1,
start_powerSGD_iter 2) is registered and only the step-0 loss is gated.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

WARMUP, WINDOWS, WINDOW_STEPS = 3, 3, 10
STEPS = WARMUP + WINDOWS * WINDOW_STEPS
GLOBAL_BATCH = 64
LOSS0, LOSS_LAST = 2.298264, 2.311658


def make_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def register_hook(model, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def worker(rank, world, port, queue, hook=None):
    torch.set_num_threads(1)
    if port is None:  # --env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        dist.init_process_group("gloo", init_method="env://")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    torch.manual_seed(0)
    x = torch.randn(6400, 784)
    y = torch.randint(0, 10, (6400,))
    model = nn.parallel.DistributedDataParallel(make_model())
    register_hook(model, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per_rank = GLOBAL_BATCH // world
    losses = [0.0, 0.0]

    def step(i):
        row = GLOBAL_BATCH * (i % 100) + per_rank * rank
        opt.zero_grad()
        loss = F.cross_entropy(model(x[row:row + per_rank]), y[row:row + per_rank])
        loss.backward()
        opt.step()
        if i == 0:
            losses[0] = loss.item()
        if i == STEPS - 1:
            losses[1] = loss.item()

    i = 0
    for _ in range(WARMUP):
        step(i)
        i += 1
    windows = []
    for _ in range(WINDOWS):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(WINDOW_STEPS):
            step(i)
            i += 1
        dist.barrier()
        t = torch.tensor([(time.perf_counter() - t0) * 1000.0 / WINDOW_STEPS], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        windows.append(t.item())
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    lt /= world
    if rank == 0:
        s = sorted(windows)
        ok = abs(lt[0].item() - LOSS0) < 5e-6 and (hook or abs(lt[1].item() - LOSS_LAST) < 5e-6)
        queue.put("RESULT python_ddp_gloo" + ("_" + hook if hook else "") + " %.2f %.2f %.6f %.6f %s - - %.2f %.2f %.2f" %
                  (s[0], s[len(s) // 2], lt[0].item(), lt[1].item(), "ok" if ok else "FAIL",
                   windows[0], windows[1], windows[2]))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--hook", choices=["fp16", "bf16", "powersgd"])
    ap.add_argument("--env", action="store_true", help="this process only, rank from the environment")
    args = ap.parse_args()
    if args.env:
        class Printer:
            def put(self, line):
                print(line, flush=True)
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, Printer(), args.hook)
        return 0
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, 2, args.port, queue, args.hook)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        for p in procs:
            if p.is_alive():
                p.kill()
        print("w_ddp.py: workers exited with", codes, file=sys.stderr)
        return 1
    line = queue.get()
    print(line, flush=True)
    return 0 if " ok " in line else 1


if __name__ == "__main__":
    sys.exit(main())
