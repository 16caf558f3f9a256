"""Costs of an MLPerf run that a steady training step does not show, as functions of the layout and the scale.

A run's time-to-train is warm-up + steps x step + evaluations x evaluation. Next to the steady step physics
(`step`), three kinds of cost do not shrink with more GPUs, so they decide the error at scale:

- **Warm-up inside the timed region** (once per run): the first steps run slower than the steady ones while the
  caching allocator grows its pools, kernels are autotuned and CUDA graphs are captured (`warmup_steps` extra
  step-times), and every process group's NCCL/RCCL communicator is created lazily by its first collective
  (`comm_init_s` per group and per doubling of its size: the bootstrap exchanges every member's address and the
  topology search and connection setup grow with the members; the groups of one kind are created in parallel, the
  kinds one after another).
- **A fixed cost per evaluation**: switching to evaluation mode, restarting the evaluation data loader, the
  metric's all-reduce and the host synchronisation around it (`eval_fixed_s`), plus one tree synchronisation.
- **Per-step synchronisation and stragglers**: every step ends in collectives and host synchronisation over all
  ranks, a tree whose levels across the scale-out fabric each cost a network round trip and the host work around
  it (`sync_log2_s` per doubling of the NVLink domains spanned: 0 inside one 8-GPU board or one NVL72 rack), and
  waits for the slowest rank: with independent per-GPU jitter of relative size `straggler_cv` on the busy time,
  the expected maximum of N GPUs is that time x cv x E[max of N standard normals] (~sqrt(2 ln N)).

The constant host work per step (optimizer launch, Python, data loading not hidden) stays `step_overhead_s`.
Every coefficient is an `Efficiency` field fitted on published runs (`calibrate`), bounded and pulled toward
its prior. Stdlib only.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.workload import ClusterLayout

_NORMAL = NormalDist()


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals]: 0 for n = 1, Blom's approximation
    Phi^-1((n - 0.375) / (n + 0.25)) otherwise (within 3% of the exact value; n = 2 exact,
    1/sqrt(pi))."""
    if n <= 1:
        return 0.0
    if n == 2:
        return 1 / math.sqrt(math.pi)
    return _NORMAL.inv_cdf((n - 0.375) / (n + 0.25))


def process_groups(layout: ClusterLayout) -> dict[str, int]:
    """Communicators one rank creates in the timed region, by kind -> members (kinds with one member need none).

    Megatron's groups: tensor parallel (tp), context parallel (cp), the gradient reduction group (data parallel
    x context parallel, "dp_cp"), pipeline neighbours (pp: point-to-point pairs set up per stage pair) and the world
    group for the loss/metric all-reduce and barriers.
    """
    groups = {
        "tp": layout.tp,
        "cp": layout.cp,
        "dp_cp": layout.dp * layout.cp,
        "pp": 2 if layout.pp > 1 else 1,
        "world": layout.gpus,
    }
    return {k: n for k, n in groups.items() if n > 1}


def comm_init_units(layout: ClusterLayout) -> float:
    """Sum over the rank's communicators of (1 + log2 members): the work `comm_init_s` prices."""
    return sum(1 + math.log2(n) for n in process_groups(layout).values())


def warmup_s(layout: ClusterLayout, step_s: float, eff: Efficiency) -> float:
    """Seconds of the timed region beyond the steady steps and the evaluations: the software release's one-off
    seconds (`Efficiency.one_off_s`, fitted on the public logs), plus extra step-times of the first steps and
    communicator creation where a set prices them (the published sets do not: their logs' first training segments
    run at the steady rate, so what start-up costs is in the one-off)."""
    return eff.one_off_s + eff.warmup_steps * step_s + eff.comm_init_s * comm_init_units(layout)


def step_sync_s(gpus: int, domains: int, busy_s: float, eff: Efficiency) -> tuple[float, float]:
    """(tree synchronisation, straggler wait) seconds per step for `gpus` ranks in `domains` NVLink domains with
    `busy_s` of work each.

    The synchronisation tree's levels inside an NVLink domain cost microseconds; each level across the scale-out
    fabric costs a network round trip plus the host work around it, so the tree term counts domains: log2(domains).
    The straggler term counts GPUs: each one's clocks, thermals and kernel timing jitter on its own.
    """
    sync = eff.sync_log2_s * math.log2(domains) + eff.fabric_sync_s if domains > 1 else 0.0
    return sync, eff.straggler_cv * expected_max_normal(gpus) * busy_s


def domains(gpus: int, nvlink_domain: int) -> int:
    """NVLink domains `gpus` GPUs span (8-GPU boards, or up to 72 GPUs of an NVL72 rack, per domain)."""
    return max(1, -(-gpus // max(1, nvlink_domain)))


def eval_fixed_s(domains: int, eff: Efficiency) -> float:
    """Seconds per evaluation besides its forward passes: the fixed switch-over plus one tree synchronisation over
    `domains` NVLink domains."""
    return eff.eval_fixed_s + (eff.sync_log2_s * math.log2(domains) + eff.fabric_sync_s if domains > 1 else 0.0)
