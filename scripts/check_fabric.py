#!/usr/bin/env python3
"""Check the collective fabric before a multi-node run: who is where, and all-reduce / all-gather bus bandwidth.

Run it under the same launcher as training (it depends on torch only):

    torchrun --nproc_per_node 8 scripts/check_fabric.py --min-busbw 40 --json fabric.json      # one node
    srun ... torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 --rdzv_backend c10d ... scripts/check_fabric.py
    torchrun --nproc_per_node 2 scripts/check_fabric.py --max-bytes 4194304                     # CPU, gloo

NCCL on CUDA (one GPU per rank, LOCAL_RANK), gloo on CPU. First every node measures inside itself (one subgroup
per node: ranks [k*LOCAL_WORLD_SIZE, (k+1)*LOCAL_WORLD_SIZE), as torchrun numbers them), then the whole world.
Bandwidths follow nccl-tests (GB = 1e9 bytes): algbw = S / t; busbw = algbw * 2(n-1)/n for all-reduce and
algbw * (n-1)/n for all-gather, S being the all-reduce buffer or the all-gather *output* (n ranks x S/n each).
t is the mean over --iters back-to-back calls after --warmup untimed ones, of the slowest rank of the group.
With --min-busbw, a (scope, op) whose busbw at the largest size is lower fails the run (exit 1 on every rank).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=int, default=MiB, help="smallest message in bytes (default 1 MiB)")
    p.add_argument("--max-bytes", type=int, default=(1024 if cuda else 16) * MiB,
                   help="largest message in bytes (default 1 GiB on CUDA, 16 MiB on CPU)")
    p.add_argument("--factor", type=int, default=2, help="size multiplier between steps (default 2)")
    p.add_argument("--warmup", type=int, default=5 if cuda else 2, help="untimed calls per size (default 5, CPU 2)")
    p.add_argument("--iters", type=int, default=20 if cuda else 5, help="timed calls per size (default 20, CPU 5)")
    p.add_argument("--min-busbw", type=float, default=0.0, metavar="GBPS",
                   help="fail if busbw at the largest size is below this, in GB/s (default 0: no check)")
    p.add_argument("--min-node-busbw", type=float, default=None, metavar="GBPS",
                   help="separate threshold for the within-node scope (default: --min-busbw)")
    p.add_argument("--ranks-per-node", type=int, default=0, metavar="N",
                   help="ranks per node group (default LOCAL_WORLD_SIZE); e.g. 2 to try the two scopes on one host")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON (rank 0)")
    p.add_argument("--timeout", type=float, default=300, help="process-group timeout in seconds (default 300)")
    args = p.parse_args()
    if args.min_bytes <= 0 or args.max_bytes < args.min_bytes or args.factor < 2 or args.iters < 1:
        p.error("need 0 < --min-bytes <= --max-bytes, --factor >= 2 and --iters >= 1")
    return args


def sizes(args) -> list[int]:
    out, s = [], args.min_bytes
    while s <= args.max_bytes:
        out.append(s)
        s *= args.factor
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def numel_for(nbytes: int, n: int) -> int:
    return max(n, nbytes // 4 // n * n)             # 4-byte floats; all-gather needs n equal chunks


def time_op(op: str, nbytes: int, group, n: int, device, warmup: int, iters: int) -> float:
    """Mean seconds per call on this rank (zeros, so repeated sums stay finite)."""
    numel = numel_for(nbytes, n)
    buf = torch.zeros(numel, dtype=torch.float32, device=device)
    chunk = buf[: numel // n].clone()
    if op == "all_reduce":
        call = lambda: dist.all_reduce(buf, group=group)
    else:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
        call = lambda: gather(buf, chunk, group=group)
    for _ in range(warmup):
        call()
    sync(device)
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def bandwidth(op: str, nbytes: int, n: int, seconds: float) -> tuple[float, float]:
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)


def main() -> int:
    args = parse_args()
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    me = {"rank": rank, "local_rank": local_rank, "host": socket.gethostname(),
          "device": torch.cuda.get_device_name(device) if cuda else "cpu",
          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    ranks = [None] * world
    dist.all_gather_object(ranks, me)
    if world % local_world:
        raise SystemExit(f"check_fabric: world size {world} is not a multiple of {local_world} ranks per node")
    nodes = [list(range(k, k + local_world)) for k in range(0, world, local_world)]
    node_groups = [dist.new_group(r) for r in nodes]    # every rank creates every group, in the same order
    my_node = rank // local_world
    if rank == 0:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-"
        print(f"torch {torch.__version__}, backend {backend}, NCCL {nccl}, world {world} = "
              f"{len(nodes)} node(s) x {local_world}")
        print(f"{'rank':>5} {'local':>5}  {'host':24s} {'device':28s} CUDA_VISIBLE_DEVICES")
        for r in ranks:
            print(f"{r['rank']:5d} {r['local_rank']:5d}  {r['host']:24s} {r['device']:28s} {r['cuda_visible_devices']}")
        for k, members in enumerate(nodes):
            hosts = sorted({ranks[i]["host"] for i in members})
            if len(hosts) > 1:
                print(f"warning: node group {k} (ranks {members[0]}-{members[-1]}) spans hosts {hosts}; "
                      f"its 'node' numbers are not intra-node")

    # each scope: (name, group for this rank, its size, the rank lists that run it concurrently)
    scopes = []
    if local_world > 1:
        scopes.append(("node", node_groups[my_node], local_world, nodes))
    if len(nodes) > 1:
        scopes.append(("world", dist.group.WORLD, world, [list(range(world))]))
    mine = {}                                           # (scope, op, bytes) -> this rank's seconds
    for scope, group, n, _ in scopes:
        for op in ("all_reduce", "all_gather"):
            for nbytes in sizes(args):
                mine[(scope, op, nbytes)] = time_op(op, nbytes, group, n, device, args.warmup, args.iters)
    every = [None] * world
    dist.all_gather_object(every, mine)

    results, failures = [], []
    for scope, _, n, rank_lists in scopes:
        limit = args.min_node_busbw if scope == "node" and args.min_node_busbw is not None else args.min_busbw
        for op in ("all_reduce", "all_gather"):
            for nbytes in sizes(args):
                # one row per scope/op/size: the worst group (slowest of its ranks), as the run will see it
                per_group = [(max(every[r][(scope, op, nbytes)] for r in members), members) for members in rank_lists]
                secs, members = max(per_group)
                used = 4 * numel_for(nbytes, n)
                algbw, busbw = bandwidth(op, used, n, secs)
                row = {"scope": scope, "op": op, "bytes": used, "ranks": n, "time_us": secs * 1e6,
                       "algbw_GBps": algbw, "busbw_GBps": busbw, "worst_host": ranks[members[0]]["host"]}
                results.append(row)
                if nbytes == sizes(args)[-1] and limit > 0 and busbw < limit:
                    failures.append(f"{scope} {op} {nbytes} B: busbw {busbw:.2f} GB/s < {limit:g} GB/s "
                                    f"(worst group starts at rank {members[0]}, {row['worst_host']})")
    if rank == 0:
        print(f"\n{'scope':6s} {'op':10s} {'ranks':>5s} {'bytes':>12s} {'time us':>11s} {'algbw GB/s':>11s} "
              f"{'busbw GB/s':>11s}  worst host")
        for r in results:
            print(f"{r['scope']:6s} {r['op']:10s} {r['ranks']:5d} {r['bytes']:12d} {r['time_us']:11.1f} "
                  f"{r['algbw_GBps']:11.2f} {r['busbw_GBps']:11.2f}  {r['worst_host']}")
        if not scopes:
            print("nothing to measure: a single rank")
        elif len(nodes) == 1:
            print("(one node: the world is the node, so there is no separate world scope)")
        for f in failures:
            print(f"FAIL: {f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"backend": backend, "world_size": world, "local_world_size": local_world,
                           "ranks": ranks, "nodes": nodes, "results": results, "failures": failures,
                           "min_busbw": args.min_busbw, "min_node_busbw": args.min_node_busbw}, fh, indent=1)
            print(f"wrote {args.json}")
        print("FAILED" if failures else "OK")
    dist.barrier(device_ids=[local_rank] if cuda else None)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
