"""The device mesh of a `Layout`: named axes, and the sub-meshes and process groups the layers need.

Mesh axes, outermost first: pp, dp_replicate, dp_shard, tp. Only axes with degree > 1 appear, so a single
process gets no mesh at all, and code asks for axes by name, never by position. Expert parallelism (ep) is
not an axis of its own: it borrows ranks from dp_shard, which `expert_mesh` splits into dp_shard_mod_ep x ep.
Every rule about which layouts are valid lives in `paratrain/layout.py`; this module only builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.layout import Layout


@dataclass
class ParallelDims:
    layout: Layout
    mesh: object = None  # DeviceMesh over every rank, None for a single process
    dp_mesh: object = None  # 1-D data-parallel mesh (dp_replicate x dp_shard flattened when both exist)

    @classmethod
    def build(cls, layout: Layout, device_type: str) -> "ParallelDims":
        """Create the mesh (collective: every rank calls it). The flattened dp mesh is made here, once, because
        slicing flattened axes from the root is deprecated."""
        axes = layout.mesh_axes()
        if not axes:
            return cls(layout)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, tuple(s for _, s in axes), mesh_dim_names=tuple(n for n, _ in axes))
        dp_axes = tuple(n for n, _ in axes if n.startswith("dp_"))
        dp_mesh = mesh[dp_axes]._flatten("dp") if len(dp_axes) > 1 else (mesh[dp_axes[0]] if dp_axes else None)
        return cls(layout, mesh, dp_mesh)

    @property
    def dp_group(self):
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None

    @property
    def dp_rank(self) -> int:
        """This rank's position among the data-parallel ranks: which slice of each global batch it reads."""
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

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
        """The mesh FSDP shards (and for HSDP replicates) over; None when FSDP is off."""
        return self.mesh[self.layout.fsdp_axes] if self.layout.uses_fsdp else None

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
