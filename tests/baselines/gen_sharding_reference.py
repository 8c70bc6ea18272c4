#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Regenerates the references of tests/unit/data/sharding.cpp:

1. torch.randperm orders: torch.randperm(n, generator=torch.Generator().manual_seed(s)).
2. The sweep over Accelerate's BatchSamplerShard: for n in 0..13, batch size
   1..5, 2..5 processes, every (split_batches, even_batches, drop_last) with
   split_batches only where the batch size divides, one line per rank
   "<n> <bs> <P> <rank> <split> <even> <drop> <len(list(shard))>:[i,...,]...\\n";
   prints the text's length and FNV-1a 64 hash, which the test rebuilds from
   accel's shard_batches().

BatchSamplerShard is taken from Accelerate's own source (its class is
extracted from data_loader.py and run as it is, without the rest of the
package, which needs more than Debian has). Run with Debian's python3-torch:

    git clone https://github.com/huggingface/accelerate && git -C accelerate checkout 000e52b
    /usr/bin/python3 tests/baselines/gen_sharding_reference.py accelerate/src/accelerate/data_loader.py
"""
import ast
import math
import sys

import torch
from torch.utils.data import BatchSampler, SequentialSampler


def load_batch_sampler_shard(path):
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BatchSamplerShard")
    namespace = {"BatchSampler": BatchSampler, "math": math, "torch": torch}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), path, "exec"), namespace)
    return namespace["BatchSamplerShard"]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    shard_class = load_batch_sampler_shard(sys.argv[1])

    for n, seed in ((10, 42), (10, 43), (7, 0)):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        print(f"randperm({n}, seed {seed}) = {order}")

    text = []
    for n in range(14):
        for bs in range(1, 6):
            for procs in range(2, 6):
                for f in range(8):
                    split, even, drop = bool(f & 1), bool(f & 2), bool(f & 4)
                    if split and bs % procs:
                        continue
                    for rank in range(procs):
                        sampler = BatchSampler(SequentialSampler(range(n)), bs, drop)
                        shard = shard_class(sampler, procs, rank, split_batches=split, even_batches=even)
                        batches = list(shard)
                        line = f"{n} {bs} {procs} {rank} {int(split)} {int(even)} {int(drop)} {len(batches)}:"
                        line += "".join("[" + "".join(f"{i}," for i in b) + "]" for b in batches)
                        text.append(line + "\n")
    data = "".join(text).encode()
    h = 0xCBF29CE484222325
    for c in data:
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    print(f"BatchSamplerShard sweep: {len(text)} lines, {len(data)} bytes, FNV-1a 64 0x{h:016x}")


if __name__ == "__main__":
    main()
