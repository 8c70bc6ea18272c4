"""Workload W and the transformer workload through Hugging Face Accelerate
(mixed_precision="bf16"), the Python half of the comparison with
gpu_bench.cpp: the same model, data and settings. Prints one JSON line per
workload. Usage: python3 accelerate_bench.py [w|transformer|all] [timed_steps]"""
import json
import sys
import time

import torch
from accelerate import Accelerator


def time_steps(warmup, timed, step):
    ms, loss = [], 0.0
    for i in range(warmup + timed):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(i)
        torch.cuda.synchronize()
        if i >= warmup:
            ms.append((time.perf_counter() - t0) * 1000)
    return ms, loss


def report(workload, ms, loss, detail):
    print(json.dumps({"impl": "accelerate", "workload": workload,
                      "median_ms": round(sorted(ms)[len(ms) // 2], 3),
                      "min_ms": round(min(ms), 3),
                      "peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                      "final_loss": round(loss, 6), "steps": len(ms), "detail": detail}), flush=True)


def bench_w(acc, timed):
    torch.manual_seed(0)
    x, y = torch.randn(6400, 784), torch.randint(0, 10, (6400,))
    torch.manual_seed(1)
    model = torch.nn.Sequential()
    model.append(torch.nn.Linear(784, 2048)); model.append(torch.nn.ReLU())
    model.append(torch.nn.Linear(2048, 2048)); model.append(torch.nn.ReLU())
    model.append(torch.nn.Linear(2048, 2048)); model.append(torch.nn.ReLU())
    model.append(torch.nn.Linear(2048, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    x, y = x.to(acc.device), y.to(acc.device)

    def step(i):
        b = i % 100
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[64 * b:64 * b + 64]), y[64 * b:64 * b + 64])
        acc.backward(loss)
        opt.step()
        return loss.item()

    torch.cuda.reset_peak_memory_stats()
    ms, loss = time_steps(3, timed, step)
    report("W", ms, loss, "MLP 784-2048-2048-2048-10, batch 64, SGD")


def bench_transformer(acc, timed):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, dim_feedforward=4096, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    torch.manual_seed(1)
    x = torch.randn(512, 32, 1024).to(acc.device)
    target = torch.randn(512, 32, 1024).to(acc.device)

    def step(_):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        acc.backward(loss)
        opt.step()
        return loss.item()

    torch.cuda.reset_peak_memory_stats()
    ms, loss = time_steps(3, timed, step)
    report("transformer", ms, loss,
           "12 x TransformerEncoderLayer(1024, 16, ff 4096), batch 32, seq 512, AdamW")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    timed = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    acc = Accelerator(mixed_precision="bf16")
    if which in ("w", "all"):
        bench_w(acc, timed * 5)
    if which in ("transformer", "all"):
        bench_transformer(acc, timed)
