"""Golden outputs of the simulator and the dry runs: capture them, or check the current code against them.

A restructuring must not move a number. This script runs a fixed list of `scaletrain` commands (predict and plan
JSON for every benchmark's model, `sim validate` in sample, `sim calibrate`, `predict --from-config` and the README's
dry runs) in one process and writes their stdout to `tests/golden/cli_outputs.json`.
`tests/unit/test_golden_outputs.py` runs the same commands and compares. A change that is meant to move numbers (a
physics change) regenerates the file with `--update` and says so in its commit.

    python3 scripts/golden_outputs.py            # compare, print the commands whose output changed
    python3 scripts/golden_outputs.py --update   # rewrite tests/golden/cli_outputs.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "cli_outputs.json"

_PREDICT = [
    "--model gpt3-175b --gpu h100 --gpus 10752 --node nd-h100-v5 --gbs 2688 --tp 4 --pp 8 --vp 12 --mbs 1 --fp8"
    " --calibration v3.1",
    "--model gpt3-175b --gpu mi300x --gpus 256 --tp 8 --pp 4 --fp8",
    "--model llama2-70b-lora --gpu h200 --gpus 512 --node nd-h200-v5 --gbs 64 --tp 4 --cp 2 --fp8",
    "--model llama2-70b-lora --gpu gb300 --gpus 72 --cp 8 --fp4 --gbs 72",
    "--model llama2-70b-lora --gpu gb300 --gpus 72 --cp 8 --fp4",
    "--model llama2-70b-lora --gpu mi355x --gpus 8 --tp 1 --fp8 --calibration v5.0",
    "--model llama31-405b --gpu gb200 --gpus 5120 --gbs 1280 --tp 4 --pp 8 --vp 8 --cp 2 --mbs 1 --fp4",
    "--model llama31-405b --gpu h100 --gpus 8192 --gbs 1536 --tp 8 --pp 8 --vp 8 --cp 2 --mbs 1 --fp8"
    " --calibration v5.0",
    "--model llama31-8b --gpu b200 --gpus 8 --gbs 16 --mbs 2 --fp4",
    "--model llama31-8b --gpu h200 --gpus 64 --tp 2 --recompute selective --zero 1",
    "--model gpt-oss-20b --gpu gb200 --gpus 64 --ep 8 --fp8 --moe-imbalance 1.2 --gbs 64",
    "--model deepseek-v3-671b --gpu gb300 --gpus 1024 --tp 1 --ep 32 --fp8",
    "--model deepseek-v3-671b --gpu h100 --gpus 1024 --tp 8 --ep 16 --fp8 --recompute full",
    "--model deepseek-v3-671b --gpu h100 --gpus 1024 --tp 2 --pp 16 --vp 2 --ep 32 --fp8 --recompute full",
]
_PLAN = [
    "--model gpt3-175b --gpu h200 --gpus 512 --top 3 --calibration v4.1",
    "--model llama2-70b-lora --gpu h200 --gpus 512 --top 3",
    "--model llama2-70b-lora --gpu h200 --gpus 512 --top 3 --as-trained",
    "--model llama31-405b --gpu gb300 --gpus 2048 --top 3",
    "--model llama31-8b --gpu h100 --gpus 64 --top 3",
    "--model gpt-oss-20b --gpu b200 --gpus 64 --top 3",
    "--model deepseek-v3-671b --gpu gb300 --gpus 1024 --top 3",
]
COMMANDS: list[str] = (
    [f"predict {a} --json" for a in _PREDICT]
    + [f"plan {a} --json" for a in _PLAN]
    + [
        "sim validate --json",
        "sim calibrate --out {tmp}/eff.json",
        "predict --from-config --model gpt3-175b --world-size 10752 --parallel.tp 4 --parallel.pp 8"
        " --parallel.pp_virtual 12 --parallel.pp_schedule interleaved_1f1b --train.global_batch_size 2688"
        " --train.micro_batch_size 1 --json",
        "predict --from-config --model llama2-70b --world-size 64 --parallel.tp 8 --parallel.pp 4"
        " --train.micro_batch_size 1 --json",
        "train --dry-run --world-size 10752 --preset gpt3-175b --parallel.tp 4 --parallel.pp 8"
        " --parallel.pp_virtual 12 --parallel.pp_schedule interleaved_1f1b --train.global_batch_size 2688"
        " --train.micro_batch_size 1",
        "train --dry-run --world-size 512 --gpu h200 --preset llama2-70b-lora --set parallel.tp=4"
        " --set parallel.cp=2 --set train.fp8=true",
        "train --dry-run --world-size 64 --preset llama2-70b --parallel.tp 8 --parallel.pp 4"
        " --train.micro_batch_size 1",
    ]
)


def run_one(command: str, tmp: str) -> dict:
    """Run one `scaletrain` command in this process; its exit code, stdout and (for `sim calibrate`) the file."""
    from scaletrain.cli.main import main

    argv = shlex.split(command.format(tmp=tmp))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    text = out.getvalue().replace(tmp, "{tmp}")
    result: dict = {"exit": code}
    if "--json" in argv:
        result["json"] = json.loads(text)
    else:
        result["stdout"] = text
    if command.startswith("sim calibrate"):
        fitted = json.loads(Path(tmp, "eff.json").read_text())
        fitted.pop("fitted_at", None)
        result["fitted"] = fitted
    return result


# Every architecture's proxy, fp32: the plain model's parameters (names, shapes, init) and one forward/backward.
MODEL_PRESETS = [
    "gpt3-proxy",
    "llama-proxy",
    "llama31-8b-proxy",
    "llama2-70b-lora-proxy",
    "gpt-oss-20b-proxy",
    "deepseek-v3-671b-proxy",
]


def model_fingerprint(preset: str) -> dict:
    """Parameter names, shapes and init sums of `preset`'s plain model, and its loss and gradient norms on a fixed
    batch: a model-code move that changes a name, an init stream or the arithmetic shows here."""
    import torch

    from scaletrain.config import resolve
    from scaletrain.model.build import build_model
    from scaletrain.model.loss import loss_sum

    cfg = resolve(preset, overrides=["train.threads=1"], host=False).model
    torch.manual_seed(0)
    model = build_model(cfg, seed=1234).float()
    seq = min(cfg.seq_len, 64)
    tokens = (torch.arange(2 * (seq + 1)).reshape(2, seq + 1) * 7919) % cfg.vocab_size
    logits = model(tokens[:, :-1])
    loss = loss_sum(logits.float(), tokens[:, 1:]) / tokens[:, 1:].numel()
    loss.backward()
    return {
        "params": {
            n: [list(p.shape), round(float(p.detach().double().square().sum()), 6)] for n, p in model.named_parameters()
        },
        "loss": round(float(loss.detach()), 6),
        "grad_norms": {
            n: round(float(p.grad.double().norm()), 6) for n, p in model.named_parameters() if p.grad is not None
        },
    }


def run_all() -> dict[str, dict]:
    """Every command's result, keyed by the command, and every architecture's model fingerprint."""
    import torch

    os.environ.pop("SCALETRAIN_EFFICIENCY", None)
    os.environ["COLUMNS"] = "120"  # rich tables wrap at the terminal width
    torch.set_num_threads(1)  # fixed reduction order
    with tempfile.TemporaryDirectory() as tmp:
        out = {c: run_one(c, tmp) for c in COMMANDS}
    out |= {f"model {p}": model_fingerprint(p) for p in MODEL_PRESETS}
    return out


def differences(a: object, b: object, path: str = "", rel: float = 0.0) -> list[str]:
    """Where two JSON values differ; floats within `rel` relative difference count as equal."""
    if isinstance(a, float) and isinstance(b, float | int) and not isinstance(b, bool):
        same = (
            a == b
            or (math.isnan(a) and math.isnan(b))
            or (math.isfinite(a) and math.isclose(a, b, rel_tol=rel, abs_tol=0.0))
        )
        return [] if same else [f"{path}: {a!r} != {b!r}"]
    if type(a) is not type(b):
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        assert isinstance(b, dict)
        out = [f"{path}.{k}: only on one side" for k in sorted(set(a) ^ set(b))]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}.{k}", rel)
        return out
    if isinstance(a, list):
        assert isinstance(b, list)
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]", rel)]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the golden file from the current code")
    args = parser.parse_args()
    now = run_all()
    if args.update:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(now)} outputs to {GOLDEN}")
        return 0
    golden = json.loads(GOLDEN.read_text())
    bad = 0
    for command in sorted(set(golden) | set(now)):
        diff = differences(golden.get(command), now.get(command))
        if diff:
            bad += 1
            print(f"CHANGED: scaletrain {command}\n  " + "\n  ".join(diff[:10]))
    print(f"{len(now) - bad} of {len(now)} outputs identical to {GOLDEN.name}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
