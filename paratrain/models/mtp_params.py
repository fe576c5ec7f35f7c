"""Multi-token prediction (DeepSeek-V3; the nn.Module: models/mtp.py) as a side head (`paratrain.models.family.
SideHead`, registered in models/registry.py): its parameter table, its cost, the layouts it refuses and its verify
rows. Torch-free: the estimator, the planner, the pipeline split and Hugging Face export read it through the seam.
"""

from __future__ import annotations

from paratrain.models.args import ModelArgs
from paratrain.models.family import Param, SideHead

NAME = "mtp"  # the model's attribute and its parameters' prefix (`mtp.{d}.`)


def mtp_params(args: ModelArgs, block) -> list[Param]:
    """The modules after the output head: each depth's block (of index n_layers + d - 1, named `mtp.{d-1}.block.`;
    `block(i)` the family's table of block i), its input norms, its 2C -> C projection (replicated: a small matrix
    beside the block's) and its own final norm. `layer` None: on a pipeline's last stage, with the head; not exported
    (transformers' DeepseekV3 has no such modules)."""
    C, out = args.dim, []
    for d in range(args.mtp_depth):
        p = f"{NAME}.{d}."
        out += [Param(p + "block." + q.name.split(".", 2)[2], q.shape, q.role, None, q.matmul, exported=False)
                for q in block(args.n_layers + d)]
        out += [Param(p + "enorm.weight", (C,), "norm", exported=False),
                Param(p + "hnorm.weight", (C,), "norm", exported=False),
                Param(p + "eh_proj.weight", (C, 2 * C), "replicated", matmul=True, exported=False),
                Param(p + "norm.weight", (C,), "norm", exported=False)]
    return out


def layout_problem(layout, args: ModelArgs) -> str | None:
    if layout.cp > 1 and args.mtp_depth:
        return (f"parallel.cp={layout.cp} does not support multi-token prediction (model.mtp_depth > 0): depth d reads "
                "the tokens d places ahead, in another rank's slice of the sequence")
    return None


MTP = "model.mtp_depth=1"
MOE = "model.preset=tiny-moe"
# One module after the last block on the MoE model; under a pipeline on the dense one, its module on the last stage.
VERIFY_ROWS = {
    "mtp-fsdp2": (2, "fsdp", MOE, MTP),
    "mtp-tp2+sp": (2, "nodp,tp=2", MOE, MTP),
    "mtp-pp2-1f1b": (2, "nodp,pp=2,sched=1f1b", MTP),
    "mtp-pp2-interleaved": (2, "nodp,pp=2,sched=interleaved_1f1b", MTP),
    "mtp-ep2": (2, "fsdp,ep=2", MOE, MTP),
}

SIDE_HEAD = SideHead(
    name=NAME, module="paratrain.models.mtp:MultiTokenPrediction", params=mtp_params,
    blocks=lambda args: args.mtp_depth, metric="mtp_loss",  # the mean of its depths' losses, unweighted
    weight=lambda args: args.mtp_loss_weight, layout_problem=layout_problem, verify_rows=VERIFY_ROWS)
