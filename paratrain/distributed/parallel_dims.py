"""The parallel layout: degrees validated against the world size and the model, then a named-axis DeviceMesh.

Mesh axes, outermost first: pp, dp_replicate, dp_shard, tp. Only axes with degree > 1 appear,
so a single process gets no mesh at all, and code asks for axes by name, never by position.
Expert parallelism (ep) is not an axis of its own: it borrows ranks from dp_shard, which
`expert_mesh` splits into dp_shard_mod_ep x ep.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import ParallelConfig
from paratrain.errors import ConfigError
from paratrain.models.llama import ModelArgs

SHARDED_MODES = ("zero2", "zero3", "fsdp", "hsdp")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_mode: str
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    ep: int = 1  # experts sharded over this many of the dp_shard ranks

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> "ParallelDims":
        # pp > 1: stages, schedule and microbatches are checked by distributed/pipeline.plan_pipeline.
        mode = "fsdp" if p.dp_mode == "zero3" else p.dp_mode
        rest, r = divmod(world_size, p.tp * p.pp)
        if r:
            raise ConfigError(f"parallel.tp ({p.tp}) x parallel.pp ({p.pp}) does not divide the world size {world_size}")
        replicate, shard = p.dp_replicate, p.dp_shard
        if mode in ("ddp", "zero1"):
            if shard not in (-1, 1):
                raise ConfigError(f"parallel.dp_shard={shard} needs a sharded dp_mode (zero2, fsdp or hsdp), not {mode}")
            shard = 1
            if replicate == 1:
                replicate = rest
        elif mode in ("zero2", "fsdp"):
            if replicate != 1:
                raise ConfigError(f"parallel.dp_replicate={replicate} with dp_mode={mode}: use dp_mode=hsdp to replicate shards")
        elif mode == "hsdp" and replicate == 1 and world_size > 1:
            raise ConfigError("dp_mode=hsdp needs parallel.dp_replicate > 1 (replicas) and dp_shard (ranks per replica)")
        if shard == -1:
            shard, r = divmod(rest, replicate)
            if r or shard < 1:
                raise ConfigError(f"parallel.dp_replicate ({replicate}) does not divide the {rest} ranks left by tp x pp")
        if p.ep > 1:
            if mode not in SHARDED_MODES:
                raise ConfigError(f"parallel.ep={p.ep} needs dp_mode fsdp, zero2 or hsdp (experts are sharded over the "
                                  f"data-parallel ranks), not {mode}")
            if shard % p.ep:
                raise ConfigError(f"parallel.ep={p.ep} does not fit the mesh: expert parallelism borrows its ranks from "
                                  f"dp_shard={shard}, which it must divide")
        dims = cls(world_size, mode, replicate, shard, p.tp, p.pp, p.sequence_parallel, p.loss_parallel, p.ep)
        product = replicate * shard * p.tp * p.pp
        if product != world_size:
            raise ConfigError(
                f"parallel degrees dp_replicate={replicate} x dp_shard={shard} x tp={p.tp} x pp={p.pp} = {product}, "
                f"but the world size is {world_size}")
        if p.tp > 1 and mode in ("ddp", "zero1") and replicate > 1:
            raise ConfigError(f"dp_mode={mode} does not compose with tp; use dp_mode=fsdp or hsdp with tp")
        return dims

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def validate_model(self, args: ModelArgs) -> None:
        """Divisibility checks that would otherwise fail deep inside a collective."""
        if self.ep > 1:
            if not args.moe_experts:
                raise ConfigError(f"parallel.ep={self.ep} needs a mixture-of-experts model (model.moe_experts > 0)")
            if args.moe_experts % self.ep:
                raise ConfigError(f"model.moe_experts={args.moe_experts} is not divisible by parallel.ep={self.ep}")
        if self.tp > 1:
            names = ["n_heads", "n_kv_heads", "dim"]
            if not all(args.is_moe_layer(i) for i in range(args.n_layers)):
                names.append("ffn_hidden")  # dense MLPs are sharded by hidden unit; routed experts are not
            for name in names:
                value = getattr(args, name)
                if value % self.tp:
                    raise ConfigError(f"model {name}={value} is not divisible by parallel.tp={self.tp}")
            shared = args.expert_hidden * args.moe_shared_experts if args.moe_experts else 0
            if shared % self.tp:
                raise ConfigError(f"shared-expert width {shared} (model.moe_ffn_hidden x moe_shared_experts) is not "
                                  f"divisible by parallel.tp={self.tp}")
            if args.vocab_size % self.tp:
                raise ConfigError(f"vocab size {args.vocab_size} is not divisible by parallel.tp={self.tp} "
                                  "(the embedding and output are sharded by vocabulary)")
            if args.tie_embeddings:
                raise ConfigError("tied embeddings do not compose with tensor parallelism; set model.tie_embeddings=false")

    def validate_batch(self, global_batch: int, micro_batch: int, seq_len: int) -> int:
        """Returns accumulation steps; global batch = micro_batch x accum x dp."""
        per_step = micro_batch * self.dp
        if global_batch % per_step:
            raise ConfigError(f"global batch {global_batch} is not divisible by micro_batch ({micro_batch}) x "
                              f"data-parallel degree ({self.dp}) = {per_step}")
        if self.tp > 1 and self.sequence_parallel and seq_len % self.tp:
            raise ConfigError(f"training.seq_len={seq_len} is not divisible by parallel.tp={self.tp} (sequence parallel)")
        return global_batch // per_step

    def mesh_axes(self) -> list[tuple[str, int]]:
        axes = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp)]
        return [(name, size) for name, size in axes if size > 1]

    def build_mesh(self, device_type: str):
        """(mesh with named axes, 1-D data-parallel mesh). The dp mesh is 'dp_replicate' x 'dp_shard'
        flattened when both exist, and is kept here because slicing flattened axes from the root is deprecated.
        Both are None for a single process."""
        from torch.distributed.device_mesh import init_device_mesh

        axes = self.mesh_axes()
        if not axes:
            return None, None
        mesh = init_device_mesh(device_type, tuple(s for _, s in axes), mesh_dim_names=tuple(n for n, _ in axes))
        dp_axes = tuple(n for n, _ in axes if n.startswith("dp_"))
        if len(dp_axes) > 1:
            return mesh, mesh[dp_axes]._flatten("dp")
        return mesh, (mesh[dp_axes[0]] if dp_axes else None)

    def expert_mesh(self, mesh):
        """The mesh with dp_shard split into (dp_shard_mod_ep, ep), ep innermost (an ep group is ep consecutive
        dp_shard ranks); same ranks and root as `mesh`. None without expert parallelism."""
        if self.ep == 1:
            return None
        return mesh._unflatten("dp_shard", (self.dp_shard // self.ep, self.ep), ("dp_shard_mod_ep", "ep"))

    def describe(self) -> str:
        parts = [f"{n}={s}" for n, s in self.mesh_axes()] or ["single process"]
        if self.ep > 1:
            parts.append(f"ep={self.ep} (within dp_shard)")
        return f"{' x '.join(parts)} ({self.dp_mode if self.dp > 1 else 'no data parallelism'})"
