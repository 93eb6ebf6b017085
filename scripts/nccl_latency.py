#!/usr/bin/env python3
"""NCCL collective latency for decode-sized messages between the GPUs of one host (issue 8):
all-reduce (sum) and all-gather of 8-64 KB bf16 messages, CUDA-event timed, median of many
iterations after warm-up. Uses torch.distributed's NCCL backend (the same NCCL library the Rust
executors load), one process per GPU. Run on a multi-GPU machine with NCCL_NVLS_ENABLE=0.

usage: python3 scripts/nccl_latency.py [--iters 2000]
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_KB = [8, 16, 32, 64]


def worker(rank, world, iters, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    rows = []
    for kb in SIZES_KB:
        n = kb * 1024 // 2  # bf16 elements in the message
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(n * world, device="cuda", dtype=torch.bfloat16)
        for name, op in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_into_tensor(gathered, x))):
            for _ in range(100):
                op()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                op()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1000.0)
            rows.append((name, kb, statistics.median(times), sorted(times)[int(0.99 * len(times))]))
    if rank == 0:
        out.extend(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    world = torch.cuda.device_count()
    assert world >= 2, f"needs at least 2 GPUs, found {world}"
    mgr = mp.Manager()
    out = mgr.list()
    mp.spawn(worker, args=(world, a.iters, 29533, out), nprocs=world)
    print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, torch {torch.__version__}, "
          f"{world} x {torch.cuda.get_device_name(0)}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    print("| collective | message | median µs | p99 µs |")
    print("|---|---|---|---|")
    for name, kb, med, p99 in out:
        print(f"| {name} | {kb} KB | {med:.1f} | {p99:.1f} |")


if __name__ == "__main__":
    main()
