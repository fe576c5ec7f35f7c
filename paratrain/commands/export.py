"""`paratrain export RUN_DIR|step-N --format hf|peft --out DIR`: a checkpoint as a Hugging Face model folder, or a
LoRA checkpoint's adapters as a PEFT adapter folder (paratrain/training/export.py and peft_export.py write them)."""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import OneLineArgumentParser
from paratrain.modes import WEIGHT_DTYPES
from paratrain.runlock import refuse_if_live


def main(argv: list[str]) -> int:
    p = OneLineArgumentParser(prog="paratrain export",
                                description="Write a checkpoint as a Hugging Face model folder.")
    p.add_argument("checkpoint", help="a run folder (its newest complete checkpoint) or a step-N folder")
    p.add_argument("--format", required=True, choices=["hf", "peft"],
                   help="hf: transformers / vLLM / llama.cpp layout (LoRA: merged into the weights); peft: a LoRA "
                        "checkpoint's adapters as a PEFT adapter folder for its Hugging Face base")
    p.add_argument("--out", required=True, help="folder to create")
    p.add_argument("--dtype", default="bf16", choices=WEIGHT_DTYPES)
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    a = p.parse_args(argv)
    # lazy: torch (the checkpoint's reader) is not needed for --help and the argument errors
    from paratrain.inference import find_checkpoint
    from paratrain.training.export import export_hf, parse_size
    from paratrain.training.peft_export import export_peft

    if a.overwrite:  # replacing a folder inside a live run would pull files from under it
        refuse_if_live(Path(a.out), "paratrain export --overwrite")
    max_shard = parse_size(a.max_shard_size)
    ckpt = find_checkpoint(a.checkpoint)
    if a.format == "peft":
        adapted = export_peft(ckpt, Path(a.out), a.dtype, a.overwrite)
        print(f"exported {ckpt} -> {a.out}: a PEFT LoRA adapter (rank {adapted.lora.rank}, "
              f"{len(adapted.targets)} projections, {a.dtype}) for {adapted.hf_folder}")
        return 0
    plan = export_hf(ckpt, Path(a.out), a.dtype, max_shard, a.overwrite)
    arch = plan.config["architectures"][0]
    print(f"exported {ckpt} -> {a.out}: {arch}, {len(plan.shards)} safetensors file(s), {a.dtype}, "
          f"vocab {plan.vocab:,}")
    return 0
