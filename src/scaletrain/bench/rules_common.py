"""Checks every official pretraining recipe shares: optimizer constants, quality target and evaluation cadence."""

from __future__ import annotations

import math

from scaletrain import benchmarks
from scaletrain.config import Config

from .mllog import C


def differs(a: float, b: float) -> bool:
    """True when two rule values differ beyond float noise (the rules compare decimal constants)."""
    return not math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def fixed_recipe_problems(
    cfg: Config, name: str, fixed: dict[str, float], target: float, eval_interval: int
) -> list[str]:
    """One message per optimizer field in `fixed` (optim.<field> -> required value), target or cadence that differs."""
    o, t = cfg.optim, cfg.train
    out = [
        f"optim.{field}={getattr(o, field):g}: {name} requires {value:g}"
        for field, value in fixed.items()
        if differs(getattr(o, field), value)
    ]
    if differs(t.target_eval_loss, target):
        out.append(f"train.target_eval_loss={t.target_eval_loss:g}: {name} requires {target:g}")
    if t.eval_interval_samples != eval_interval:
        out.append(f"train.eval_interval_samples={t.eval_interval_samples}: {name} requires {eval_interval}")
    return out


def submission_benchmark(name: str) -> str:
    """What a scaletrain benchmark logs as submission_benchmark: the package's constant for its official name. A
    proxy logs it too: it follows that benchmark's event protocol, and its own rules file (bench/rules/*_proxy.yaml)
    accepts exactly that value."""
    spec = benchmarks.get(name)
    return str(getattr(C, spec.mllog_constant)) if spec.mllog_constant else spec.name
