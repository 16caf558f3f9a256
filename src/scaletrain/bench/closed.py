"""The closed-division checker: which of its benchmark's closed-division rules a config breaks.

The rules are data in each benchmark's `BenchmarkSpec.closed` (scaletrain/benchmarks.py: the model shape, the RCPs'
batch sizes, the LR/GBS pairing, the schedule in steps, the fixed recipe, the quality target and the cadence); this
module states them on the config, one message per broken rule, so `bench` says what to change before a run. The
compliance checker verifies only what reaches the log, never the model shape, the batch-size range or the cadence.

Sources: MLCommons training_policies (training_rules.adoc) and the `mlperf-logging` rules files and RCP tables
(compliance_checker/training_<r>/closed_<name>.yaml, rcp_checker/training_<r>/rcps_<name>.json); summarised in
docs/benchmarks.md. Proxies have none: they scale model, data and target by design and follow their own rules files.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

from scaletrain import benchmarks
from scaletrain.benchmarks import (
    BenchmarkSpec,
    ClosedRule,
    Fixed,
    GbsRange,
    LrLinear,
    LrSqrt,
    LrSteps,
    Shape,
    Steps,
)
from scaletrain.config import Config

__all__ = ["official_rule_violations", "differs"]

# Steps.point -> (the optim field that sets it, the OptimConfig method giving its step at a GBS, how the message
# says what the config gives)
_POINTS = {
    "warmup": ("warmup_samples", "warmup_steps", "gives {} warm-up steps"),
    "decay": ("decay_samples", "decay_steps", "ends the cosine at step {}"),
    "checkpoint": ("checkpoint_samples", "init_checkpoint_step", "starts its schedule at step {}"),
}


def differs(a: float, b: float) -> bool:
    """True when two rule values differ beyond float noise (the rules compare decimal constants)."""
    return not math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def official_rule_violations(cfg: Config) -> list[str]:
    """Closed-division rules of cfg.bench.benchmark that `cfg` breaks, one message each in the spec's order; [] when
    compliant, and always for a proxy."""
    name = cfg.bench.benchmark
    if benchmarks.is_proxy(name):
        return []
    spec = benchmarks.get(name)
    return [msg for rule in spec.closed for msg in _broken(rule, cfg, spec)]


def _field(cfg: Config, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), cfg)


def _exp(x: float) -> str:
    """8e-5, not 8e-05: how the rules files write the constants in a formula."""
    return re.sub(r"e([+-])0(\d)", r"e\1\2", f"{x:g}")


def _shown(value: Any, want: Any) -> str:
    """A config value (or the required one) in a message, formatted by the kind of the required value `want`."""
    if isinstance(want, str):
        return repr(value)
    if isinstance(want, float):
        return f"{value:g}"
    return str(value)


def _broken(rule: ClosedRule, cfg: Config, spec: BenchmarkSpec) -> list[str]:
    """The message of `rule` when `cfg` breaks it, else []."""
    name, o = spec.name, cfg.optim
    gbs = cfg.train.global_batch_size
    if isinstance(rule, Fixed):
        want = rule.required(spec)
        have = _field(cfg, rule.field)
        if isinstance(want, frozenset):
            ok = set(have) == want
        elif isinstance(want, float) and not rule.exact:
            ok = not differs(have, want)
        else:
            ok = have == want
        if ok:
            return []
        if isinstance(want, frozenset):
            have_text, want_text = str(list(have)), str(sorted(want))
        else:
            have_text, want_text = _shown(have, want), _shown(want, want)
        said = rule.why.format(name=name) if rule.why else f"{name} requires {want_text}"
        note = f" {rule.note}" if rule.note else ""
        return [f"{rule.label or rule.field}={have_text}: {said}{note}"]
    if isinstance(rule, Shape):
        labels = "/".join(label for label, _, _ in rule.dims)
        have_dims = tuple(_field(cfg, path) for _, path, _ in rule.dims)
        want_dims = tuple(value for _, _, value in rule.dims)
        if have_dims == want_dims:
            return []
        return [f"model {labels}={'/'.join(map(str, have_dims))}: {name} requires {'/'.join(map(str, want_dims))}"]
    if isinstance(rule, GbsRange):
        if rule.low <= gbs <= rule.high:
            return []
        return [
            f"train.global_batch_size={gbs}: {name} reference convergence points cover {rule.low}..{rule.high} only"
        ]
    if isinstance(rule, LrSteps):
        if gbs <= rule.low_max_gbs:
            allowed = [rule.low]
        elif gbs >= rule.high_min_gbs:
            allowed = [rule.high]
        else:  # between the two reference batch sizes the rules accept either LR
            allowed = [rule.low, rule.high]
        if any(not differs(o.lr, lr) for lr in allowed):
            return []
        return [f"optim.lr={o.lr:g}: {name} at GBS {gbs} requires {' or '.join(f'{x:g}' for x in allowed)}"]
    if isinstance(rule, LrLinear):
        if o.lr * rule.base_gbs == gbs * rule.base_lr:  # exactly as the rules file compares, in floating point
            return []
        formula = f"{_exp(rule.base_lr)} * GBS / {rule.base_gbs}"
        return [f"optim.lr={o.lr:g}: {name} at GBS {gbs} requires {rule.at(gbs)!r} ({formula})"]
    if isinstance(rule, LrSqrt):
        if abs(o.lr - rule.at(gbs)) < 1e-9:  # as the rules file compares
            return []
        formula = f"{_exp(rule.base_lr)} * sqrt(GBS / {rule.base_gbs})"
        return [f"optim.lr={o.lr:g}: {name} at GBS {gbs} requires {rule.at(gbs)!r} ({formula})"]
    if isinstance(rule, Steps):
        field, steps_at, gives = _POINTS[rule.point]
        have = getattr(o, steps_at)(gbs)
        want = rule.at(gbs)
        if have == want:
            return []
        formula = f"ceil({rule.steps} * {rule.base_gbs} / GBS)" if rule.base_gbs else f"{field} = {rule.steps} * GBS"
        return [
            f"optim.{field}={getattr(o, field)} {gives.format(have)} at GBS {gbs}; {name} requires {want} ({formula})"
        ]
    raise TypeError(f"benchmark {name!r}: unknown closed-division rule {rule!r}")
