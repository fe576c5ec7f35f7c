"""A LoRA checkpoint as a PEFT adapter folder: `paratrain export RUN --format peft --out DIR`.

    DIR/adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, target_modules (Hugging Face names),
                                   base_model_name_or_path (the folder the run imported)
    DIR/adapter_model.safetensors  base_model.model.<module>.lora_A.weight (r, in) and .lora_B.weight (out, r)

which `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)` loads onto the base. paratrain's
adapter is PEFT's LoRA exactly: W x + (alpha / r) B A x, A and B by the same shapes, so nothing is transposed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from paratrain.distributed.tensors import torch_dtype
from paratrain.errors import UserError
from paratrain.files import atomic_dir
from paratrain.hf.names import hf_name, hf_names
from paratrain.modes import WEIGHT_DTYPES
from paratrain.preflight import check_export_out
from paratrain.training.adapters import AdaptedCheckpoint, init_folder_of
from paratrain.training.checkpoint import load_trainer_state

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def adapter_config(adapted: AdaptedCheckpoint, modules: list[str]) -> dict:
    lora = adapted.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(adapted.hf_folder.resolve()),
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def export_peft(ckpt: Path, out: Path, dtype: str = "bf16", overwrite: bool = False) -> AdaptedCheckpoint:
    """Write the adapters of LoRA checkpoint `ckpt` as a PEFT folder `out` (complete, or not at all)."""
    from safetensors.torch import save_file

    if dtype not in WEIGHT_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(WEIGHT_DTYPES)}, got '{dtype}'")
    state = load_trainer_state(ckpt)
    adapted = AdaptedCheckpoint.of(ckpt, state)
    if adapted is None:
        raise UserError(f"{ckpt} holds every weight, not LoRA adapters: export it with --format hf")
    if adapted.hf_folder is None:
        raise UserError(f"{ckpt}: a PEFT adapter loads onto a Hugging Face base, and this run's base is the "
                        f"{adapted.base}: --format hf writes the adapted model with the adapters merged")
    check_export_out(out, [("the checkpoint it reads", ckpt), ("the base it belongs to", init_folder_of(state))],
                     overwrite)
    names = hf_names(adapted.args)
    adapters = adapted.load_adapters(list(adapted.adapter_shapes))
    tensors, modules = {}, set()
    for weight, (a, b) in adapted.targets.items():
        module = hf_name(names, weight)[: -len(".weight")]
        modules.add(module.rsplit(".", 1)[-1])
        tensors[f"base_model.model.{module}.lora_A.weight"] = adapters[a].to(torch_dtype(dtype)).contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = adapters[b].to(torch_dtype(dtype)).contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-")), out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(adapter_config(adapted, sorted(modules)), indent=2) + "\n")
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
    return adapted
