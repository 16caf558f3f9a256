"""Single-GPU ceilings, training MFU and per-layer timings, checked against the simulator, in one call.

1. Environment: device, versions, clocks (nvidia-smi, read only), the SDPA kernel the model's attention dispatches to
   (profiled, forward and backward) and which SDPA backends accept its shape.
2. Ceilings: 8192^3 bf16 matmul (twice: the spread is the noise floor), FP8 `torch._scaled_mm` (capability >= 8.9),
   device-to-device copy (bytes read + written); medians of event-timed runs after warm-up, random data.
3. Training steps (fused AdamW, bf16 autocast, fp32 master weights, random tokens) of GPT-3 175B layer shapes
   (h 12288, 96 heads, seq 2048, 2 blocks, TP 1, micro-batch 1 and 2, vocabulary REDUCED to 1024 so the numbers are
   the blocks', as in the 96-layer model where the head is 0.35% of the FLOPs) and full gpt3-1.3b and gpt3-2.7b
   (micro-batch 4), bf16 and FP8 (all blocks FP8 in the 175B rows; first/last block bf16 in the full models, as the
   trainer does): tokens/s, model TFLOP/s (model/flops.py at the layers run), MFU against the DENSE bf16 peak.
4. FP8 vs bf16 loss on real data (default corpus, else the packaged excerpt): same init, same batches.
5. Per-layer timings (each forward/backward GEMM shape in bf16 and FP8, attention, whole block) as JSON for
   `scaletrain sim calibrate --layer-timings FILE`; the script runs that fit and prints the simulator's single-GPU
   prediction (shipped calibration and fitted) beside each measured step.

    python benchmarks/gpu_mfu.py [--quick] [--steps 10] [--reps 25] [--compile] [--out FILE] [--cpu-smoke]
                                 [--no-fp8-check | --fp8-check-steps N --fp8-check-corpus DIR]

Writes FILE (default results/gpu_mfu.json, $OUT/gpu_mfu.json when $OUT is set) and beside it <stem>.layer_timings.json,
<stem>.catalog.toml and <stem>.efficiency.json (the fit). --cpu-smoke (automatic without CUDA) shrinks every shape
to run in under a minute on 2 cores: not GPU numbers, MFU null, and the h200 comparison only exercises the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from scaletrain.config import resolve
from scaletrain.model.common import causal_attention
from scaletrain.model.flops import flops_per_token
from scaletrain.model.gpt import GPT
from scaletrain.model.loss import loss_sum
from scaletrain.sim.catalog import load_catalog, mfu_peak
from scaletrain.sim.compute import layer_gemms
from scaletrain.sim.fit import layer_timings as timings_fit
from scaletrain.sim.workload import ClusterLayout, load_workload
from scaletrain.train.cpu_bf16 import bf16_gemm_context, gemm_mode
from scaletrain.train.host import peak_memory_gib, setup_cpu
from scaletrain.train.optim import build_optimizer

try:  # written concurrently; without it the script still runs and reports FP8 as unavailable
    from scaletrain.model.fp8 import convert_to_float8, fp8_supported
    FP8_ERROR = None
except ImportError as exc:
    FP8_ERROR = f"scaletrain.model.fp8 not importable: {exc}"

RESULTS = Path(__file__).resolve().parent / "results"
L175 = ["model.n_layers=2", "model.vocab_size=1024"]          # the 175B layer shapes with a reduced vocabulary
# (name, preset, model overrides, micro-batch, skip first/last block in FP8) per training configuration.
GPU_RUNS = [("175B-layers", "gpt3-175b", L175, 1, False), ("175B-layers", "gpt3-175b", L175, 2, False),
            ("gpt3-1.3b", "gpt3-1.3b", [], 4, True), ("gpt3-2.7b", "gpt3-2.7b", [], 4, True)]
SMALL = "model.n_layers={} model.d_model={} model.n_heads={} model.seq_len=128 model.vocab_size={}"   # smoke shapes
SMOKE_RUNS = [("175B-layers", "gpt3-175b", SMALL.format(2, 256, 4, 1024).split(), b, False) for b in (1, 2)]
SMOKE_RUNS += [(n, n, SMALL.format(3, d, 2, 2048).split(), 2, True) for n, d in (("gpt3-1.3b", 128),
                                                                                  ("gpt3-2.7b", 160))]


class Sizes:
    """Every size the modes differ in: GPU mode fills an H200 within ~6 minutes, smoke runs in seconds on 2 cores."""

    def __init__(self, smoke: bool, quick: bool, steps: int | None, check_steps: int | None = None,
                 reps: int | None = None):
        self.smoke = smoke
        self.gemm_n = 1024 if smoke else 8192
        self.copy_bytes = 256 * 2**20 if smoke else 4 * 2**30      # ~70x the H200's 60 MB L2
        self.curve = [128, 256, 512] if smoke else [512, 1024, 2048, 4096, 8192]
        self.runs = SMOKE_RUNS if smoke else GPU_RUNS
        self.warmup = 1 if smoke else 3
        self.steps = steps or (2 if smoke else 5 if quick else 10)
        self.reps = reps or (3 if smoke else 10 if quick else 25)   # per GEMM / attention / block timing
        # FP8-vs-bf16 check: (model overrides on gpt3-125m, micro-batch, steps)
        self.check = ((["model.n_layers=4", "model.d_model=64", "model.n_heads=2", "model.seq_len=64"], 4,
                       check_steps or 30) if smoke else (["model.seq_len=512"], 8, check_steps or (100 if quick else 300)))


# --- timing
def timed(fn, device: torch.device, warmup: int, reps: int) -> dict:
    """Median (and 10th/90th percentile) seconds of fn(i) over `reps` calls after `warmup` calls.

    CUDA: an event pair around each call (the work is asynchronous; events time it on the device); CPU: the host
    clock. Percentiles show the spread, so a difference between two variants smaller than it reads as noise.
    """
    cuda = device.type == "cuda"
    for i in range(warmup):
        fn(i)
    events, times = [], []
    for i in range(reps):
        if cuda:  # device-side marks in stream order: they time the queued work, not the Python that queued it
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        t0 = time.perf_counter()
        fn(warmup + i)
        if cuda:
            events[-1][1].record()
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) / 1e3 for a, b in events]
    times.sort()
    return {"median_s": statistics.median(times), "p10_s": times[len(times) // 10],
            "p90_s": times[min(len(times) - 1, (9 * len(times)) // 10)], "reps": reps}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --- environment
def peak_tflops(device: torch.device) -> tuple[str, float] | None:
    """(catalog key, dense bf16 TFLOP/s) of a CUDA device, as the trainer's MFU takes it; None on CPU or an unknown GPU."""
    return mfu_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def environment(device: torch.device) -> dict:
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
           (platform.processor() or platform.machine()), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "threads": torch.get_num_threads(), "fp8_module": FP8_ERROR is None,
           "fp8_native": FP8_ERROR is None and fp8_supported(device), "fp8_error": FP8_ERROR,
           "cpu_bf16_gemm": gemm_mode() if device.type == "cpu" else None}
    peak = peak_tflops(device)
    env["dense_bf16_peak"] = {"key": peak[0], "tflops": peak[1]} if peak else None
    if device.type == "cuda":
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["clocks_start"] = clocks()
    return env


def clocks() -> str | None:
    """SM/memory clocks, temperature and power as nvidia-smi reports them (read only: the card is left as found)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def sdpa_report(cfg, mbs: int, device: torch.device) -> dict:
    """Which SDPA kernel the model's attention runs (aten op names seen by the profiler, forward and backward,
    under the training autocast) and which backends accept the shape when forced one at a time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    hd = cfg.d_model // cfg.n_heads
    # bf16 leaves: what the model's qkv projection hands SDPA under autocast.
    q, k, v = (torch.randn(mbs, cfg.n_heads, cfg.seq_len, hd, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = causal_attention(q, k, v)
        out.float().sum().backward()
    prefixes = ("aten::_scaled_dot_product", "aten::_flash", "aten::_efficient", "aten::_cudnn")
    ops = sorted({e.key for e in prof.key_averages() if e.key.startswith(prefixes)})
    names = {"flash": "flash_attention", "efficient": "efficient_attention", "cudnn": "cudnn", "math": "math"}
    used = next((n for n, frag in names.items() if any(frag in o for o in ops)), "math")
    def accepts(backend) -> bool:
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")   # "not used because ..." per refusing backend
                causal_attention(q, k, v)
            return True
        except RuntimeError:
            return False
    accepted = {n: accepts(b) for n, b in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                           ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH))}
    return {"used": used + ("_cpu" if device.type == "cpu" and used == "flash" else ""), "aten_ops": ops,
            "accepted": accepted, "shape": [mbs, cfg.n_heads, cfg.seq_len, hd], "dtype": "bf16 (autocast)"}


# --- ceilings
def gemm(m: int, n: int, k: int, dtype: str, device: torch.device, z: Sizes, fast: bool = True) -> dict:
    """Median seconds of one [m,k] x [k,n] GEMM (B column-major, as F.linear and cuBLASLt's FP8 want it); FP8 with
    fast accumulation where `fast` (forward GEMMs, as scaletrain.model.fp8 runs them), exact for gradients."""
    # Rotate input sets so consecutive calls do not all find their inputs in L2 (METHOD.md).
    per_set = (m * k + n * k + m * n) * (1 if dtype == "fp8" else 2)
    sets = 1 if device.type == "cpu" else max(1, min(16, (256 * 2**20) // per_set))
    fp8 = dtype == "fp8"
    a = [torch.randn(m, k, device=device).to(torch.float8_e4m3fn if fp8 else torch.bfloat16) for _ in range(sets)]
    b = [torch.randn(n, k, device=device).to(a[0].dtype).t() for _ in range(sets)]
    one = torch.ones((), device=device)
    kw = {"scale_a": one, "scale_b": one, "out_dtype": torch.bfloat16, "use_fast_accum": fast} if fp8 else {}
    mm = torch._scaled_mm if fp8 else torch.mm
    t = timed(lambda i: mm(a[i % sets], b[i % sets], **kw), device, z.warmup, z.reps)
    return {"dtype": dtype, "m": m, "n": n, "k": k, "fast_accum": fast and dtype == "fp8", "seconds": t["median_s"],
            "spread_s": [t["p10_s"], t["p90_s"]], "tflops": 2 * m * n * k / t["median_s"] / 1e12}


def ceilings(device: torch.device, fp8_native: bool, z: Sizes) -> dict:
    n = z.gemm_n
    # The bf16 ceiling is measured twice: the difference between the two is the noise floor of every comparison.
    out = {"gemm_n": n, "gemm_bf16": gemm(n, n, n, "bf16", device, z),
           "gemm_bf16_again": gemm(n, n, n, "bf16", device, z),
           "gemm_fp8": gemm(n, n, n, "fp8", device, z) if fp8_native else None}
    src = torch.randn(z.copy_bytes // 4, device=device)          # random, never zeros (METHOD.md)
    dst = torch.empty_like(src)
    t = timed(lambda i: dst.copy_(src), device, 3, z.reps)
    out["copy"] = {"bytes": z.copy_bytes, "seconds": t["median_s"], "gbps": 2 * z.copy_bytes / t["median_s"] / 1e9}
    out["gemm_bf16_tflops"] = max(out["gemm_bf16"]["tflops"], out["gemm_bf16_again"]["tflops"])
    out["gemm_fp8_tflops"] = out["gemm_fp8"]["tflops"] if out["gemm_fp8"] else None
    out["copy_gbps"] = out["copy"]["gbps"]
    return out


# --- models
def build(cfg, device: torch.device) -> GPT:
    """A GPT on `device` with N(0, init_std) weights drawn by torch's generator: the trainer's counter-based init
    gives the same distribution but is far slower for billions of weights, and the values don't matter here."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.zero_() if name.endswith("bias") else p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, cfg.init_std)
    return model


def to_fp8(model: GPT, skip_first_last: bool) -> int:
    return convert_to_float8(model, "tensorwise", skip_first_last=skip_first_last)


def train_row(name, preset, sets, mbs, fp8, skip, device, z: Sizes, compile_blocks: bool) -> dict:
    """Time optimizer steps of one configuration (random tokens; two batches alternate)."""
    cfg = resolve(preset, overrides=sets).model
    row = {"name": name, "model": preset, "set": sets, "mbs": mbs, "precision": "fp8" if fp8 else "bf16",
           "compile": compile_blocks, "layers": cfg.n_layers, "d_model": cfg.d_model, "seq_len": cfg.seq_len,
           "vocab": cfg.padded_vocab}
    free(device)
    try:
        model = build(cfg, device)
        if fp8:
            row["fp8_linears"] = to_fp8(model, skip)
        if compile_blocks:
            for key, block in list(model.blocks.items()):
                model.blocks[key] = torch.compile(block)
        opt = build_optimizer(model.parameters(), resolve(preset).optim, device.type)   # fused AdamW on CUDA
        gen = torch.Generator().manual_seed(0)
        data = [torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_len + 1), generator=gen).to(device) for _ in range(2)]

        def step(i):
            x = data[i % 2]
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_sum(model(x[:, :-1]), x[:, 1:]) / x[:, 1:].numel()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        t = timed(step, device, z.warmup, z.steps)
    except torch.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
        return row
    finally:
        model = opt = None  # noqa: F841 - release before the next configuration
    tokens, fpt, peak = mbs * cfg.seq_len, flops_per_token(cfg), peak_tflops(device)
    row.update(step_s=t["median_s"], step_spread_s=[t["p10_s"], t["p90_s"]], tokens_per_s=tokens / t["median_s"],
               flops_per_token=fpt, model_tflops=tokens / t["median_s"] * fpt / 1e12,
               peak_mem_gib=peak_memory_gib(device))
    row["mfu"] = row["model_tflops"] / peak[1] if peak else None   # against the dense bf16 peak, FP8 rows too
    return row


def layer_timings(name, preset, sets, mbs, device, z: Sizes, fp8_ok: bool, fp8_native: bool) -> dict:
    """GEMMs (forward, input-grad, weight-grad shapes), attention and one whole block of a configuration."""
    cfg = resolve(preset, overrides=[*sets, "model.n_layers=1"]).model
    w = load_workload(preset, tuple([*sets, "model.n_layers=1"]))
    out = {"gemm": [], "attention": [], "blocks": []}
    for m, n, k in layer_gemms(w, ClusterLayout(gpus=1, mbs=mbs, gbs=mbs, sp=False)):
        for shape, pass_ in (((m, n, k), "fwd"), ((m, k, n), "dgrad"), ((n, k, m), "wgrad")):
            for dtype in ("bf16", "fp8") if fp8_native else ("bf16",):
                out["gemm"].append({**gemm(*shape, dtype, device, z, pass_ == "fwd"), "pass": pass_, "layer_of": name})
    hd = cfg.d_model // cfg.n_heads
    q, k, v = (torch.randn(mbs, cfg.n_heads, cfg.seq_len, hd, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    g = torch.randn(mbs, cfg.n_heads, cfg.seq_len, hd, device=device, dtype=torch.bfloat16)
    fwd = timed(lambda i: causal_attention(q, k, v), device, 2, z.reps)["median_s"]
    both = timed(lambda i: causal_attention(q, k, v).backward(g), device, 2, z.reps)["median_s"]
    out["attention"].append({"layer_of": name, "mbs": mbs, "seq_len": cfg.seq_len, "heads": cfg.n_heads,
                             "head_dim": hd, "fwd_s": fwd, "bwd_s": max(both - fwd, 0.0)})
    for fp8 in (False, True) if fp8_ok else (False,):
        free(device)
        model = build(cfg, device)
        if fp8:
            to_fp8(model, skip_first_last=False)
        block = model.blocks["0"]
        x = torch.randn(mbs, cfg.seq_len, cfg.d_model, device=device, requires_grad=True)
        gy = torch.randn(mbs, cfg.seq_len, cfg.d_model, device=device)   # the block's output is fp32 (residual)

        def fwd_only(i):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return block(x)

        f = timed(fwd_only, device, 2, z.reps)["median_s"]
        fb = timed(lambda i: fwd_only(i).backward(gy), device, 2, z.reps)["median_s"]
        out["blocks"].append({"layer_of": name, "model": preset, "set": sets, "mbs": mbs, "fp8": fp8, "fwd_s": f,
                              "bwd_s": max(fb - f, 0.0)})
        model = block = None
    return out


# --- FP8 check
def fp8_check(device: torch.device, z: Sizes, corpus_dir: str | None = None) -> dict:
    """Train gpt3-125m (shape per mode) twice from the same init on the same real batches, bf16 and FP8 (current
    scaling, first/last block bf16); pass when the mean loss over the last quarter agrees within 2% (relative).

    The data: the prepared corpus directory `corpus_dir` when given (its vocabulary sets the model's), else the
    default corpus, else the packaged excerpt tokenized at 2048."""
    from scaletrain.config import DataConfig, default_data_dir
    from scaletrain.data.corpus import DefaultCorpus, default_paths, prepare_excerpt
    from scaletrain.data.prepare import load_dataset
    from scaletrain.data.samples import TrainSamples
    sets, mbs, steps = z.check
    if corpus_dir:
        corpus, source = DefaultCorpus.at(Path(corpus_dir)), f"corpus {corpus_dir}"
    else:
        corpus, source = default_paths(default_data_dir(DataConfig())), "default corpus"
    if not corpus.exists():
        corpus, source = prepare_excerpt(Path(tempfile.mkdtemp()) / "excerpt", 2048), "packaged excerpt"
    vocab = int(corpus.info()["recipe"]["vocab_size"])
    cfg = resolve("gpt3-125m", overrides=[*sets, f"model.vocab_size={vocab}"])
    samples = TrainSamples(load_dataset(str(corpus.train_prefix), None, None), cfg.model.seq_len, 1234)
    losses, tol, converted = {}, 0.02, 0
    for fp8 in (False, True):
        free(device)
        model = build(cfg.model, device)
        if fp8:
            converted = to_fp8(model, skip_first_last=True)
        opt = build_optimizer(model.parameters(), dataclasses.replace(cfg.optim, lr=6e-4), device.type)
        curve = []
        for i in range(steps):
            for group in opt.param_groups:   # linear warm-up over the first 10%, then constant
                group["lr"] = 6e-4 * min(1.0, (i + 1) / max(1, steps // 10))
            x, y = samples.batch(i * mbs, mbs)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_sum(model(x.to(device)), y.to(device)) / y.numel()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        losses["fp8" if fp8 else "bf16"] = curve
        model = opt = None
    tail = max(1, steps // 4)
    b, f = (statistics.mean(losses[k][-tail:]) for k in ("bf16", "fp8"))
    finite = all(math.isfinite(v) for c in losses.values() for v in c)
    return {"model": "gpt3-125m", "set": [*sets, f"model.vocab_size={vocab}"], "mbs": mbs, "steps": steps,
            "data": source, "fp8_linears": converted, "bf16_final": b, "fp8_final": f, "rel_diff": f / b - 1,
            "tolerance": tol, "finite": finite, "pass": finite and abs(f / b - 1) <= tol, "losses": losses}


# --- simulator
def sim_compare(rows: list[dict], timings: dict, gpu: str, comparable: bool) -> dict:
    """Fit the simulator to this run's layer timings (what `sim calibrate --layer-timings` does) and predict each
    measured configuration on one GPU (tp = pp = 1, no optimizer sharding) with the shipped and fitted values."""
    from scaletrain.sim.catalog import load_catalog
    from scaletrain.sim.predict import predict
    fit = timings_fit.fit_layer_timings({**timings, "gpu": gpu}, load_catalog())
    fitted = timings_fit.apply_gpu_override(load_catalog(), fit["gpu"], fit["catalog"])
    out = []
    for r in (r for r in rows if "step_s" in r):
        w = load_workload(r["model"], tuple(r["set"]))
        lay = ClusterLayout(gpus=1, mbs=r["mbs"], gbs=r["mbs"], sp=False, fp8=r["precision"] == "fp8", zero=0)
        shipped = predict(w, lay, gpu)
        mine = predict(w, lay, gpu, eff=fit["efficiency"], catalog=fitted)
        out.append({"name": r["name"], "mbs": r["mbs"], "precision": r["precision"], "measured_s": r["step_s"],
                    "shipped_s": shipped.step_time_s, "shipped_compute_s": shipped.breakdown.get("compute"),
                    "fitted_s": mine.step_time_s})
    return {"gpu": gpu, "comparable": comparable, "fit": fit["report"], "catalog": fit["catalog"],
            "efficiency": fit["efficiency"].to_dict(), "rows": out}


# --- main
def print_table(res: dict) -> None:
    """The summary table (the device tool returns the end of the output, so this comes last)."""
    env, c, sd = res["environment"], res["ceilings"], res["sdpa"]
    peak = env["dense_bf16_peak"]
    print(f"{env['device']} | torch {env['torch']} | CUDA {env['cuda']} | SDPA kernel: "
          + (f"{sd['used']} (accepts: {', '.join(k for k, v in sd['accepted'].items() if v)})" if sd else "?"))
    if c:
        fp8 = f"{c['gemm_fp8_tflops']:.0f}" if c["gemm_fp8_tflops"] else "n/a"
        print(f"ceilings: bf16 GEMM {c['gemm_n']}^3 {c['gemm_bf16']['tflops']:.1f} / "
              f"{c['gemm_bf16_again']['tflops']:.1f} TFLOP/s (twice), FP8 {fp8} TFLOP/s, "
              f"copy {c['copy_gbps']:.0f} GB/s (read + write)")
    mfu_head = f"MFU/dense bf16 {peak['tflops']:g}" if peak else "MFU (no dense peak)"
    print(f"{'config':12s} {'mbs':>3s} {'prec':4s} {'layers':>6s} {'step ms':>9s} {'tokens/s':>11s} "
          f"{'model TFLOP/s':>13s} {mfu_head:>20s} {'peak GiB':>8s}")
    for r in res["training"]:
        head = f"{r['name']:12s} {r['mbs']:3d} {r['precision'] + ('+c' if r['compile'] else ''):4s} {r['layers']:6d}"
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"{head} {1000 * r['step_s']:9.2f} {r['tokens_per_s']:11,.0f} {r['model_tflops']:13.2f} {mfu:>20s} "
              f"{r['peak_mem_gib']:8.2f}")
    chk = res["fp8_check"]
    if chk:
        print(f"FP8 vs bf16 loss ({chk['steps']} steps, {chk['data']}, {chk['fp8_linears']} FP8 linears): "
              f"{chk['fp8_final']:.4f} vs {chk['bf16_final']:.4f} ({100 * chk['rel_diff']:+.2f}%, tolerance "
              f"{100 * chk['tolerance']:.0f}%): {'PASS' if chk['pass'] else 'FAIL'}")
    s = res["sim"]
    if s:
        note = "" if s["comparable"] else " (measured on CPU: not comparable, code path only)"
        print(f"simulator, 1 x {s['gpu']}{note}: fitted gemm_eff {s['efficiency']['gemm_eff']:.3f}, "
              f"step overhead {1000 * s['efficiency']['step_overhead_s']:.1f} ms")
        print(f"{'config':12s} {'mbs':>3s} {'prec':4s} {'measured ms':>11s} {'shipped ms':>10s} {'(compute)':>9s} "
              f"{'fitted ms':>9s}")
        for r in s["rows"]:
            print(f"{r['name']:12s} {r['mbs']:3d} {r['precision']:4s} {1000 * r['measured_s']:11.2f} "
                  f"{1000 * r['shipped_s']:10.2f} {1000 * r['shipped_compute_s']:9.2f} {1000 * r['fitted_s']:9.2f}")
    for name, err in res["errors"].items():
        print(f"ERROR in {name}: {err}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="shrink every shape (automatic without CUDA)")
    ap.add_argument("--quick", action="store_true", help="fewer timed steps and repetitions, 100-step FP8 check")
    ap.add_argument("--steps", type=int, help="timed optimizer steps per configuration (default 10, quick 5)")
    ap.add_argument("--reps", type=int, metavar="N",
                    help="timed repetitions per GEMM, attention and block timing (default 25, quick 10, smoke 3)")
    ap.add_argument("--compile", action="store_true", help="also time bf16 rows with torch.compile per block")
    ap.add_argument("--no-fp8-check", action="store_true", help="skip the FP8-vs-bf16 loss comparison")
    ap.add_argument("--fp8-check-steps", type=int, metavar="N",
                    help="steps of each FP8-check run (default 300, quick 100, smoke 30); CPU FP8 GEMMs run torch's "
                         "reference loop, so the smoke test asks for fewer")
    ap.add_argument("--fp8-check-corpus", metavar="DIR",
                    help="a prepared corpus directory (tokenizer, train/valid prefixes, stamp, as `scaletrain data "
                         "prepare` writes) for the FP8 check instead of the default corpus; its vocabulary sets the "
                         "model's (the smoke test passes the excerpt at 1024 instead of the default corpus's 8192)")
    ap.add_argument("--sim-gpu", help="catalog GPU for the simulator comparison (default: this GPU; h200 on CPU)")
    ap.add_argument("--out", help="result JSON (default benchmarks/results/gpu_mfu.json, or $OUT/gpu_mfu.json)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.cpu_smoke or device.type == "cpu"
    for flag, value in (("--steps", args.steps), ("--reps", args.reps)):
        if value is not None and value < 1:
            ap.error(f"{flag} {value}: need at least 1")
    if args.fp8_check_steps is not None and args.fp8_check_steps < 4:
        ap.error(f"--fp8-check-steps {args.fp8_check_steps}: need at least 4 (the check compares the last quarter)")
    if args.fp8_check_corpus:
        from scaletrain.data.corpus import DefaultCorpus
        if not DefaultCorpus.at(Path(args.fp8_check_corpus)).exists():
            ap.error(f"--fp8-check-corpus {args.fp8_check_corpus}: no complete prepared corpus there")
    z = Sizes(smoke, args.quick, args.steps, args.fp8_check_steps, args.reps)
    setup_cpu(0) if device.type == "cpu" else None   # flush-to-zero etc., as the trainer does on CPU
    default = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    out = Path(args.out) if args.out else default / ("gpu_mfu_cpu_smoke.json" if smoke else "gpu_mfu.json")
    env = environment(device)
    fp8_ok, fp8_native = env["fp8_module"], env["fp8_native"]
    res = {"script": "benchmarks/gpu_mfu.py", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "mode": "cpu-smoke" if smoke else "gpu", "quick": args.quick, "environment": env, "sdpa": None,
           "ceilings": None, "training": [], "fp8_check": None, "layer_timings": None, "sim": None,
           "phase_s": {}, "errors": {}}
    timings = {"format": "scaletrain-layer-timings/1", "gpu": env["dense_bf16_peak"] and env["dense_bf16_peak"]["key"],
               "device": env["device"], "ceilings": {}, "gemm": [], "attention": [], "blocks": [], "steps": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")

    def phase(name, fn):
        """Run one phase; on failure record the error and go on (the GPU run is one prepared call), then save."""
        t0 = time.perf_counter()
        try:
            # A CPU without bf16 GEMMs runs them as fp32 arithmetic on bf16 operands, as the trainer does there.
            with bf16_gemm_context(device, "bf16"):
                fn()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON and the table, not raised
            import traceback
            res["errors"][name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            print(f"phase {name} failed: {res['errors'][name]}", flush=True)
        res["phase_s"][name] = time.perf_counter() - t0
        res["wall_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(res, indent=2) + "\n")   # partial results survive a later failure or kill

    sim_gpu = args.sim_gpu or timings["gpu"] or "h200"

    def sim():
        timings["steps"] = [{"model": r["model"], "set": r["set"], "mbs": r["mbs"], "fp8": r["precision"] == "fp8",
                             "step_s": r["step_s"]} for r in res["training"] if "step_s" in r and not r["compile"]]
        res["sim"] = sim_compare(res["training"], timings, sim_gpu, comparable=not smoke and sim_gpu == timings["gpu"])
        Path(f"{stem}.catalog.toml").write_text(timings_fit.catalog_toml(sim_gpu, res["sim"]["catalog"], out.name))
        Path(f"{stem}.efficiency.json").write_text(json.dumps(
            {"sets": {"measured/" + load_catalog().gpu(sim_gpu).generation: res["sim"]["efficiency"]}}, indent=2) + "\n")

    run = z.runs[1]
    phase("sdpa", lambda: res.update(sdpa=sdpa_report(resolve(run[1], overrides=run[2]).model, run[3], device)))
    phase("ceilings", lambda: res.update(ceilings=ceilings(device, fp8_native, z)))
    timings["ceilings"] = {k: (res["ceilings"] or {}).get(k) for k in ("gemm_bf16_tflops", "gemm_fp8_tflops",
                                                                       "copy_gbps")}
    variants = [(False, False)] + [(True, False)] * fp8_ok + [(False, True)] * args.compile   # (fp8, compile)
    for name, preset, sets, mbs, skip in z.runs:   # one phase each: a failure costs one row, not the run
        for fp8, comp in variants:
            phase(f"train {name} mbs{mbs}{' fp8' * fp8}{' compiled' * comp}", lambda: res["training"].append(
                train_row(name, preset, sets, mbs, fp8, skip, device, z, comp)))
    for name, preset, sets, mbs, _ in {(r[1], r[3]): r for r in z.runs}.values():
        phase(f"layers {name} mbs{mbs}", lambda: [timings[k].extend(v) for k, v in layer_timings(
            name, preset, sets, mbs, device, z, fp8_ok, fp8_native).items()])
    phase("gemm curve", lambda: timings["gemm"].extend(
        gemm(n, n, n, d, device, z) for n in z.curve for d in ("bf16", "fp8")[:1 + fp8_native]))
    res["layer_timings"] = timings
    Path(f"{stem}.layer_timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    if fp8_ok and not args.no_fp8_check:
        phase("fp8_check", lambda: res.update(fp8_check=fp8_check(device, z, args.fp8_check_corpus)))
    phase("sim", sim)
    env["clocks_end"] = clocks() if device.type == "cuda" else None
    phase("table", lambda: print_table(res))
    print(f"wrote {out} (+ .layer_timings.json, .catalog.toml, .efficiency.json) in {res['wall_s']:.1f} s; "
          f"phases: " + ", ".join(f"{k} {v:.1f}s" for k, v in res["phase_s"].items()))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
