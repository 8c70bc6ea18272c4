#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Prints tests/unit/sched/sched_baselines.hpp: the learning-rate (and momentum)
sequences of PyTorch's Python schedulers, the reference for accel::sched.

Run with Debian's python3-torch (1.13):
    /usr/bin/python3 tests/baselines/gen_sched_baselines.py > tests/unit/sched/sched_baselines.hpp

Each sequence holds the value at position 0 (after construction) and after each
scheduler.step() call; values are printed with 17 significant digits, which
round-trips a double exactly.
"""
import warnings

import torch

warnings.filterwarnings("ignore")  # "lr_scheduler.step() before optimizer.step()"


def make_optimizer(kind, groups):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    if kind == "sgd_nomomentum":
        return torch.optim.SGD(params, lr=0.5)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.5, betas=(0.9, 0.999))
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.5, betas=(0.9, 0.999))
    raise ValueError(kind)


def momentum_of(opt, kind):
    out = []
    for g in opt.param_groups:
        out.append(g["betas"][0] if kind.startswith("adam") else g["momentum"])
    return out


# name, optimizer, groups, OneCycleLR keyword arguments
ONE_CYCLE = [
    ("cos_default", "sgd", 1, dict(max_lr=0.1, total_steps=100)),
    ("linear", "sgd", 1, dict(max_lr=0.05, total_steps=37, pct_start=0.25, anneal_strategy="linear")),
    ("three_phase_cos", "sgd", 1, dict(max_lr=1.0, total_steps=50, three_phase=True,
                                       div_factor=10.0, final_div_factor=100.0)),
    ("three_phase_linear", "adamw", 1, dict(max_lr=0.002, total_steps=41, three_phase=True,
                                            anneal_strategy="linear", pct_start=0.4)),
    ("epochs_steps_per_epoch", "sgd", 1, dict(max_lr=0.3, epochs=4, steps_per_epoch=13)),
    ("adam_beta1", "adam", 1, dict(max_lr=0.01, total_steps=30, base_momentum=0.8,
                                   max_momentum=0.9)),
    ("multi_group", "sgd", 2, dict(max_lr=[0.1, 0.01], total_steps=25,
                                   base_momentum=[0.85, 0.8], max_momentum=[0.95, 0.9])),
    ("no_cycle_momentum", "sgd_nomomentum", 1, dict(max_lr=0.2, total_steps=10,
                                                    cycle_momentum=False, pct_start=0.5)),
    ("one_step", "sgd", 1, dict(max_lr=0.1, total_steps=1)),
]

# name, base lrs, warmup_steps, start_factor, total_steps or None, steps to run
WARMUP = [
    ("linear_lr", [0.1], 10, 0.25, None, 20),
    ("hf_linear_with_warmup", [0.1, 0.02], 5, 0.0, 20, 25),
    ("hf_no_warmup", [0.3], 0, 0.0, 8, 10),
]


def fmt(x):
    return repr(float(x)) if x == x else "NaN"


def vec(xs):
    return "{" + ", ".join(fmt(x) for x in xs) + "}"


def mat(rows):
    return "{" + ",\n      ".join(vec(r) for r in rows) + "}"


def one_cycle_case(name, kind, groups, kw):
    opt = make_optimizer(kind, groups)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, **kw)
    cycle = kw.get("cycle_momentum", True)
    lrs, moms = [sched.get_last_lr()], [momentum_of(opt, kind) if cycle else []]
    for _ in range(sched.total_steps):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr())
        moms.append(momentum_of(opt, kind) if cycle else [])
    try:  # one more step must fail: record that it does
        opt.step()
        sched.step()
        raise SystemExit("OneCycleLR did not raise past total_steps")
    except ValueError:
        pass

    def per_group(key, default):
        v = kw.get(key, default)
        return v if isinstance(v, list) else [v]

    fields = [
        '"%s"' % name,
        '"%s"' % kind,
        str(groups),
        vec(per_group("max_lr", None)),
        str(kw.get("total_steps", -1)),
        str(kw.get("epochs", -1)),
        str(kw.get("steps_per_epoch", -1)),
        fmt(kw.get("pct_start", 0.3)),
        "true" if kw.get("anneal_strategy", "cos") == "linear" else "false",
        "true" if cycle else "false",
        vec(per_group("base_momentum", 0.85)),
        vec(per_group("max_momentum", 0.95)),
        fmt(kw.get("div_factor", 25.0)),
        fmt(kw.get("final_div_factor", 1e4)),
        "true" if kw.get("three_phase", False) else "false",
        mat(lrs),
        mat(moms) if cycle else "{}",
    ]
    return "  {" + ",\n   ".join(fields) + "}"


def warmup_case(name, base_lrs, warmup, start_factor, total, steps):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in base_lrs]
    opt = torch.optim.SGD(params, lr=1.0)
    if total is None:
        # torch's own LinearLR: start_factor -> 1 over warmup steps, then hold.
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=start_factor,
                                                  end_factor=1.0, total_iters=warmup)
    else:
        # transformers.get_linear_schedule_with_warmup's lambda (start_factor 0).
        assert start_factor == 0.0

        def lr_lambda(n):
            if n < warmup:
                return float(n) / float(max(1, warmup))
            return max(0.0, float(total - n) / float(max(1, total - warmup)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    lrs = [sched.get_last_lr()]
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr())
    fields = ['"%s"' % name, vec(base_lrs), str(warmup), fmt(start_factor),
              str(total if total is not None else -1), mat(lrs)]
    return "  {" + ",\n   ".join(fields) + "}"


def main():
    print("// @generated by tests/baselines/gen_sched_baselines.py with torch %s - do not edit"
          % torch.__version__)
    print("// Reference sequences of torch.optim.lr_scheduler (Python) for tests/unit/sched.")
    print("#pragma once")
    print("#include <cstdint>")
    print("#include <vector>")
    print()
    print("namespace accel_test::sched_baselines {")
    print()
    print("struct OneCycleCase {")
    print("  const char* name;")
    print("  const char* optimizer;  // sgd | sgd_nomomentum | adam | adamw (initial lr 0.5)")
    print("  int groups;")
    print("  std::vector<double> max_lr;")
    print("  int64_t total_steps, epochs, steps_per_epoch;  // -1: not given")
    print("  double pct_start;")
    print("  bool linear, cycle_momentum;")
    print("  std::vector<double> base_momentum, max_momentum;")
    print("  double div_factor, final_div_factor;")
    print("  bool three_phase;")
    print("  std::vector<std::vector<double>> lr;        // [position][group]")
    print("  std::vector<std::vector<double>> momentum;  // [position][group]; SGD momentum or beta1")
    print("};")
    print()
    print("inline const std::vector<OneCycleCase> one_cycle_cases = {")
    print(",\n".join(one_cycle_case(*c) for c in ONE_CYCLE))
    print("};")
    print()
    print("struct WarmupCase {")
    print("  const char* name;")
    print("  std::vector<double> base_lr;  // one per parameter group")
    print("  int64_t warmup_steps;")
    print("  double start_factor;")
    print("  int64_t total_steps;  // -1: not given (torch LinearLR); else HF linear-with-warmup")
    print("  std::vector<std::vector<double>> lr;  // [position][group]")
    print("};")
    print()
    print("inline const std::vector<WarmupCase> warmup_cases = {")
    print(",\n".join(warmup_case(*c) for c in WARMUP))
    print("};")
    print()
    print("}  // namespace accel_test::sched_baselines")


if __name__ == "__main__":
    main()
