"""The device mesh of a `Layout`: named axes, and the sub-meshes and process groups the layers need.

Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, tp (torchtitan's order). Only axes with degree > 1
appear, so a single process gets no mesh at all, and code asks for axes by name, never by position. Ranks are
numbered node by node, so the innermost axes are the ones that stay within a node:

- tp innermost: two collectives per block forward and backward on the critical path, the most traffic;
- cp next: a ring exchange of K/V blocks in every attention (overlapped with the attention compute, but
  latency-bound when it is not), best between neighbours on NVLink;
- dp_shard beside cp: FSDP shards parameters over dp_shard x cp flattened into one group (context-parallel ranks
  hold different tokens, so they reduce gradients like data-parallel ranks), which is then a contiguous block of
  ranks; the loss and gradients are averaged over dp x cp;
- dp_replicate outside: HSDP's gradient all-reduce, once per step;
- pp outermost: point-to-point activations only, the traffic that tolerates the slowest links.

Expert parallelism (ep) is not an axis of its own: it borrows ranks from dp_shard, which `expert_mesh` splits
into dp_shard_mod_ep x ep. Every rule about which layouts are valid lives in `paratrain/layout.py`; this module
only builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.layout import Layout


@dataclass
class ParallelDims:
    layout: Layout
    mesh: object = None  # DeviceMesh over every rank, None for a single process
    dp_mesh: object = None  # 1-D data-parallel mesh (dp_replicate x dp_shard flattened when both exist)
    shard_mesh: object = None  # 1-D mesh FSDP shards over with cp: dp_shard x cp flattened (or cp alone)
    dp_cp_mesh: object = None  # 1-D mesh of the ranks holding different tokens (dp x cp): loss and gradient mean

    @classmethod
    def build(cls, layout: Layout, device_type: str) -> "ParallelDims":
        """Create the mesh (collective: every rank calls it). The flattened meshes are made here, once, because
        slicing flattened axes from the root is deprecated."""
        axes = layout.mesh_axes()
        if not axes:
            return cls(layout)
        # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, tuple(s for _, s in axes), mesh_dim_names=tuple(n for n, _ in axes))
        dp_axes = tuple(n for n, _ in axes if n.startswith("dp_"))
        dp_mesh = _flat(mesh, dp_axes, "dp")
        shard_mesh = dp_cp_mesh = None
        if layout.cp > 1:
            shard_mesh = _flat(mesh, layout.fsdp_shard_axes, "dp_shard_cp")
            dp_cp_mesh = _flat(mesh, (*dp_axes, "cp"), "dp_cp")
        return cls(layout, mesh, dp_mesh, shard_mesh, dp_cp_mesh)

    @property
    def dp_group(self):
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None

    @property
    def dp_rank(self) -> int:
        """This rank's position among the data-parallel ranks: which slice of each global batch it reads."""
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    @property
    def loss_group(self):
        """The ranks a step's loss is averaged over: data-parallel x context-parallel (every rank holds as many
        tokens, so the mean of their means is the mean over the global batch)."""
        return self.dp_cp_mesh.get_group() if self.dp_cp_mesh is not None else self.dp_group

    @property
    def cp_group(self):
        return self.mesh["cp"].get_group() if self.layout.cp > 1 else None

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank() if self.layout.cp > 1 else 0

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group() if self.layout.pp > 1 else None

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank() if self.layout.pp > 1 else 0

    @property
    def tp_mesh(self):
        return self.mesh["tp"] if self.layout.tp > 1 else None

    @property
    def fsdp_mesh(self):
        """The mesh FSDP shards (and for HSDP replicates) over; None when FSDP is off. With context parallelism the
        shard dimension is dp_shard x cp flattened; HSDP puts dp_replicate before it (a 2-D mesh)."""
        if not self.layout.uses_fsdp:
            return None
        if self.shard_mesh is None:
            return self.mesh[("dp_replicate", "dp_shard") if self.layout.hybrid else "dp_shard"]
        if not self.layout.hybrid:
            return self.shard_mesh
        # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh._concatenate([self.mesh["dp_replicate"], self.shard_mesh])

    def expert_mesh(self):
        """The mesh with dp_shard split into (dp_shard_mod_ep, ep), ep innermost (an ep group is ep consecutive
        dp_shard ranks); same ranks and root as `mesh`. None without expert parallelism."""
        if self.layout.ep == 1:
            return None
        return self.mesh._unflatten("dp_shard", (self.layout.dp_shard // self.layout.ep, self.layout.ep),
                                    ("dp_shard_mod_ep", "ep"))

    def coordinates(self) -> dict[str, int]:
        """This rank's position on each named axis (empty for a single process)."""
        if self.mesh is None:
            return {}
        return dict(zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate() or ()))


def _flat(mesh, names: tuple[str, ...], flat_name: str):
    """The 1-D mesh of `names` (those present in `mesh`), flattened into `flat_name` when there are several."""
    present = tuple(n for n in names if n in mesh.mesh_dim_names)
    if not present:
        return None
    return mesh[present]._flatten(flat_name) if len(present) > 1 else mesh[present[0]]
