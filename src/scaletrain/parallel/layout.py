"""The parallel layout of a run: degrees, their checks against world size and model, and the DeviceMesh.

Mesh dimensions, outermost first (torchtitan's order, so tensor parallelism stays on the fastest links, i.e.
inside an NVLink domain, and pipeline parallelism spans the slowest):

    pp, dp_replicate, dp_shard, cp, tp

Flattened views used by the trainer: "dp" = (dp_replicate, dp_shard) picks each rank's data slice;
"dp_shard_cp" = (dp_shard, cp) is what FSDP shards over (context-parallel ranks hold the same weights);
"dp_cp" = (dp_replicate, dp_shard, cp) is where gradients and losses are summed.

Expert parallelism (ep > 1) borrows ranks rather than adding a dimension (torchtitan's scheme with its expert
tensor-parallel degree 1): the dp_shard x cp x tp ranks of each (pp, dp_replicate) coordinate are regrouped as
(efsdp, ep), ep innermost, in a second DeviceMesh ("pp", "dp_replicate", "efsdp", "ep") over the same ranks. Under
tensor parallelism each tp rank routes its own sequence shard (sequence parallelism), so ep must hold whole tp
groups (a multiple of tp) and experts are never split inside a tp group. Routed experts are split over "ep" and
FSDP-sharded over "efsdp" (with "dp_replicate" under HSDP): `mesh["ep"]`, `mesh["efsdp"]`, `mesh["expert_dp"]`
(the 2-D (dp_replicate, efsdp) mesh).
The mesh is an object handed to whoever needs it; nothing here sets a process-group global.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import Config, ConfigError
from scaletrain.model.spec import model_spec
from scaletrain.sim.workload import split_problem, stage_split

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep")


class LayoutError(ConfigError):
    """A parallel layout does not fit the world size or the model; the message says which degree and why."""


def stage_sizes(
    n_layers: int, num_stages: int, first: int = -1, last: int = -1, stages: tuple[int, ...] = ()
) -> list[int] | None:
    """Blocks of each pipeline stage, in stage order; None when they do not split (why: `sim.workload.split_problem`).

    The simulator's rule (`sim.workload.stage_split`), so the trainer runs what `predict` and `plan` price: `stages`
    (one count per stage), else `first` / `last` (blocks of the first / last stage, -1 = default, the others even),
    else even, or Megatron's embedding-and-loss-as-a-layer split when only the blocks + 2 divide evenly.
    """
    return stage_split(n_layers, num_stages, first, last, tuple(stages))


@dataclass(frozen=True)
class Layout:
    """Resolved parallel degrees (dp_shard filled in) for a world of `world_size` ranks."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_virtual: int = 1
    cp: int = 1
    pp_schedule: str = "1f1b"
    sequence_parallel: bool = True
    ep: int = 1
    pp_first_layers: int = -1
    """Blocks of the first virtual stage (parallel.pp_first_layers; -1 = the default split)."""
    pp_last_layers: int = -1
    """Blocks of the last virtual stage (parallel.pp_last_layers; -1 = the default split)."""
    pp_stage_layers: tuple[int, ...] = ()
    """Blocks of every virtual stage in order (parallel.pp_stage_layers; empty = first/last or the default)."""

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> Layout:
        """Resolve cfg.parallel for `world_size` ranks (dp_shard=-1 takes what is left); raises LayoutError."""
        p = cfg.parallel
        if world_size < 1:
            raise LayoutError(f"world size {world_size}: must be >= 1")
        others = p.dp_replicate * p.tp * p.pp * p.cp
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if others < 1 or world_size % others:
                raise LayoutError(
                    f"parallel degrees dp_replicate={p.dp_replicate} x tp={p.tp} x pp={p.pp} x cp={p.cp} = {others} "
                    f"do not divide the world size {world_size}"
                )
            dp_shard = world_size // others
        layout = cls(
            world_size=world_size,
            dp_replicate=p.dp_replicate,
            dp_shard=dp_shard,
            tp=p.tp,
            pp=p.pp,
            pp_virtual=p.pp_virtual,
            cp=p.cp,
            pp_schedule=p.pp_schedule,
            sequence_parallel=p.sequence_parallel,
            ep=p.ep,
            pp_first_layers=p.pp_first_layers,
            pp_last_layers=p.pp_last_layers,
            pp_stage_layers=tuple(p.pp_stage_layers),
        )
        layout.validate(cfg)
        return layout

    # ------------------------------------------------------------------ derived sizes
    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks over which gradients are averaged (data and context parallel)."""
        return self.dp * self.cp

    @property
    def num_stages(self) -> int:
        """Pipeline stages in total (pp ranks x virtual stages each)."""
        return self.pp * self.pp_virtual

    @property
    def uneven(self) -> bool:
        """Whether the stages' blocks are given (parallel.pp_first_layers, pp_last_layers or pp_stage_layers)."""
        return self.pp_first_layers >= 0 or self.pp_last_layers >= 0 or bool(self.pp_stage_layers)

    def stage_blocks(self, n_layers: int) -> list[int] | None:
        """Blocks of each of the num_stages stages of a model of `n_layers` blocks (`stage_sizes`); None if no split."""
        return stage_sizes(n_layers, self.num_stages, self.pp_first_layers, self.pp_last_layers, self.pp_stage_layers)

    @property
    def degrees(self) -> dict[str, int]:
        """Mesh dimension name -> degree, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def data_parallel_kind(self) -> str:
        """ "none", "ddp", "fsdp" or "hsdp": how replicas and shards of the weights are kept in step."""
        if self.dp_shard * self.cp > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        if self.dp_replicate > 1:
            # DDP cannot hold DTensor (tensor-parallel) weights: use FSDP2 with a replicate-only mesh instead.
            return "ddp" if self.tp == 1 else "hsdp"
        return "none"

    def describe(self) -> str:
        """One line, e.g. 'pp2(v2,interleaved_1f1b) x dp_shard2 x tp2(sp) = 8 ranks'."""
        parts = []
        for name, deg in self.degrees.items():
            if deg > 1:
                extra = ""
                if name == "pp":
                    extra = (
                        f"(v{self.pp_virtual},{self.pp_schedule})" if self.pp_virtual > 1 else f"({self.pp_schedule})"
                    )
                if name == "tp" and self.sequence_parallel:
                    extra = "(sp)"
                parts.append(f"{name}{deg}{extra}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return " x ".join(parts or ["single"]) + f" = {self.world_size} rank{'s' if self.world_size > 1 else ''}"

    # ------------------------------------------------------------------ checks
    def problems(self, cfg: Config) -> list[str]:
        """Every reason this layout cannot train cfg, one line each (empty when it can)."""
        m, t = cfg.model, cfg.train
        out = []
        product = 1
        for deg in self.degrees.values():
            product *= deg
        if product != self.world_size:
            out.append(
                " x ".join(f"{k}={v}" for k, v in self.degrees.items())
                + f" = {product}, but the world size is {self.world_size}"
            )
        out += model_spec(m.arch).tp_problems(m, self.tp)  # the architecture's sharding rules
        facts = model_spec(m.arch).facts
        if self.cp > 1 and (facts.latent_attention or facts.windowed_attention or m.moe.n_experts > 0):
            out.append(
                f"parallel.cp={self.cp}: model.arch={m.arch!r} has no context-parallel attention (latent, sink or "
                "windowed) and MoE load statistics per context shard yet"
            )
        if self.cp > 1 and m.seq_len % (2 * self.cp):
            out.append(
                f"model.seq_len={m.seq_len} does not split into 2*cp={2 * self.cp} equal chunks "
                f"(context parallel balances causal work with two chunks per rank)"
            )
        local_seq = m.seq_len // self.cp
        if self.tp > 1 and self.sequence_parallel and local_seq % self.tp:
            out.append(
                f"sequence parallel: the per-rank sequence {local_seq} (seq_len/cp) is not a multiple of "
                f"parallel.tp={self.tp}"
            )
        if self.pp_schedule == "interleaved_1f1b":
            if self.pp_virtual < 2:
                out.append("parallel.pp_schedule='interleaved_1f1b' needs parallel.pp_virtual >= 2")
        elif self.pp_virtual > 1:
            out.append(f"parallel.pp_virtual={self.pp_virtual} needs parallel.pp_schedule='interleaved_1f1b'")
        if self.pp == 1 and self.pp_virtual > 1:
            out.append(f"parallel.pp_virtual={self.pp_virtual} needs parallel.pp >= 2")
        out += self._split_problems(m.n_layers)
        out += self._ep_problems(cfg)
        gbs, mbs = t.global_batch_size, t.micro_batch_size
        if gbs % self.dp:
            out.append(f"train.global_batch_size={gbs} is not a multiple of the data-parallel size {self.dp}")
        elif (gbs // self.dp) % mbs:
            out.append(
                f"train.micro_batch_size={mbs} does not divide the per-rank batch {gbs // self.dp} "
                f"(global_batch_size / data-parallel size {self.dp})"
            )
        elif self.pp > 1:
            n_micro = gbs // self.dp // mbs
            if n_micro < self.pp:
                out.append(
                    f"pipeline: {n_micro} micro-batches per step (global_batch_size / dp / micro_batch_size)"
                    f" leave stages idle; need at least pp={self.pp}"
                )
            elif self.pp_schedule == "interleaved_1f1b" and n_micro % self.pp:
                out.append(f"interleaved 1F1B: {n_micro} micro-batches per step must be a multiple of pp={self.pp}")
        return out

    def _split_problems(self, n_layers: int) -> list[str]:
        """Why the stages cannot hold model.n_layers blocks as parallel.pp_* asks (at most one line)."""
        given = {
            "parallel.pp_first_layers": self.pp_first_layers >= 0,
            "parallel.pp_last_layers": self.pp_last_layers >= 0,
            "parallel.pp_stage_layers": bool(self.pp_stage_layers),
        }
        named = " / ".join(k for k, v in given.items() if v)
        if self.uneven and self.pp == 1:
            return [f"{named} split pipeline stages: they need parallel.pp >= 2 (one stage holds every block)"]
        if self.pp_stage_layers and (self.pp_first_layers >= 0 or self.pp_last_layers >= 0):
            return [
                "parallel.pp_stage_layers gives every stage's blocks: leave parallel.pp_first_layers and "
                "parallel.pp_last_layers at -1 with it"
            ]
        if self.stage_blocks(n_layers) is not None:
            return []
        why = split_problem(
            n_layers, self.pp, self.pp_virtual, self.pp_first_layers, self.pp_last_layers, self.pp_stage_layers
        )
        if not self.uneven:
            return [
                f"pp x pp_virtual = {self.num_stages} stages divide neither model.n_layers={n_layers} nor "
                f"{n_layers} + 2 (the embedding and the loss counted as a layer each, as Megatron can); "
                "parallel.pp_first_layers / pp_last_layers / pp_stage_layers can split them unevenly"
            ]
        return [f"{named}: {why} (pp x pp_virtual = {self.num_stages} stages, model.n_layers={n_layers})"]

    def _ep_problems(self, cfg: Config) -> list[str]:
        n = cfg.model.moe.n_experts
        if n and self.tp > 1:
            # Each tp rank routes its own sequence shard: the shards need sequence parallelism, and the experts'
            # gradients summing over tp ranks need them in the ep group (below).
            moe_tp = (
                []
                if self.sequence_parallel
                else [
                    f"parallel.tp={self.tp} with MoE layers needs parallel.sequence_parallel=true (each tensor-parallel "
                    "rank routes its own sequence shard)"
                ]
            )
            if self.ep == 1:
                return moe_tp + [
                    f"parallel.tp={self.tp} with MoE layers needs parallel.ep a multiple of tp (experts are not "
                    "tensor-parallel; the tp ranks' tokens reach them by all-to-all)"
                ]
        else:
            moe_tp = []
        if self.ep == 1:
            return []
        if self.ep < 1:
            return [f"parallel.ep={self.ep}: must be >= 1"]
        if n == 0:
            return [f"parallel.ep={self.ep}: expert parallelism needs an MoE model (model.moe.n_experts is 0: dense)"]
        out = moe_tp
        if n % self.ep:
            out.append(f"parallel.ep={self.ep}: must divide model.moe.n_experts={n}")
        borrowed = self.dp_shard * self.cp * self.tp
        if borrowed % self.ep:
            out.append(
                f"parallel.ep={self.ep}: must divide dp_shard x cp x tp = {borrowed} (expert parallelism borrows the "
                f"data-parallel shard, context and tensor-parallel ranks)"
            )
        if self.tp > 1 and self.ep % self.tp:
            out.append(
                f"parallel.ep={self.ep} with parallel.tp={self.tp}: ep must be a multiple of tp (each tensor-parallel "
                f"rank routes its own sequence shard, so the experts' group holds whole tp groups)"
            )
        return out

    @property
    def efsdp(self) -> int:
        """Ranks holding the same routed experts, over which FSDP shards them: dp_shard x cp x tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def validate(self, cfg: Config) -> Layout:
        """Raise LayoutError listing every problem (one per line); return self when there is none."""
        problems = self.problems(cfg)
        if problems:
            head = f"parallel layout {self.describe()} cannot train this model: "
            raise LayoutError(head + "; ".join(problems))
        return self

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> ParallelMesh:
        """The 5-D DeviceMesh (size-1 dims included) with its flattened "dp", "dp_shard_cp" and "dp_cp" views.

        Needs an initialised default process group of world_size ranks.
        """
        from torch.distributed.device_mesh import init_device_mesh

        root = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=MESH_DIMS)
        flat = {
            "dp": root[("dp_replicate", "dp_shard")]._flatten(mesh_dim_name="dp"),
            "dp_shard_cp": root[("dp_shard", "cp")]._flatten(mesh_dim_name="dp_shard_cp"),
            "dp_cp": root[("dp_replicate", "dp_shard", "cp")]._flatten(mesh_dim_name="dp_cp"),
        }
        if self.ep > 1:
            from torch.distributed.device_mesh import DeviceMesh

            # The same ranks regrouped: dp_shard x cp x tp (dp_shard major, tp innermost, as in the root mesh) split
            # into (efsdp, ep); ep a multiple of tp keeps each tp group inside one ep group.
            shape = (self.pp, self.dp_replicate, self.efsdp, self.ep)
            experts = DeviceMesh(device_type, root.mesh.reshape(shape), mesh_dim_names=EXPERT_MESH_DIMS)
            flat.update({name: experts[name] for name in ("ep", "efsdp")})
            flat["expert_dp"] = experts[("dp_replicate", "efsdp")]
        return ParallelMesh(root, flat)


class ParallelMesh:
    """The run's DeviceMesh plus its flattened views, indexed by dimension name: mesh["tp"], mesh["dp_cp"].

    Flattened views are kept here rather than sliced back out of the root mesh (which torch deprecates).
    """

    def __init__(self, root, flat: dict):
        self.root = root
        self.flat = flat

    def __getitem__(self, name):
        if isinstance(name, str):
            return self.flat[name] if name in self.flat else self.root[name]
        if tuple(name) == ("dp_replicate", "dp_shard_cp"):
            # HSDP's 2-D (replicate, shard) mesh; with cp == 1 the shard dim is dp_shard itself.
            if self.root["cp"].size() == 1:
                return self.root[("dp_replicate", "dp_shard")]
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return self.root[("dp_replicate", "dp_shard_cp")]
        return self.root[tuple(name)]

    @property
    def mesh(self):
        """Rank ids laid out in the root mesh's shape (a tensor)."""
        return self.root.mesh

    @property
    def mesh_dim_names(self):
        """Names of the root mesh's dimensions, outermost first."""
        return self.root.mesh_dim_names
