"""The recipe (paratrain/recipe.py) is read once per run, and the estimator is asked about it in one way: the trainer's
memory estimate (RUN/memory-estimate.txt), `paratrain estimate --model RUN/config.toml` and `paratrain train --dry-run`
print the same memory per rank, memory tiers included."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from paratrain.capabilities.activation_offload import ActivationOffload
from paratrain.capabilities.chunked_loss import ChunkedLoss
from paratrain.capabilities.cpu_offload import CpuOffload
from paratrain.config import Config
from paratrain.layout import Layout
from paratrain.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
TIERS = ["--memory.cpu_offload=true", "--memory.activation_offload=all", "--memory.loss_chunks=4"]


def paratrain(folder: Path, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "paratrain", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def memory_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip().startswith("memory per rank:")]
    assert lines, output
    return lines[0]


def test_header_estimate_and_dry_run_agree_with_memory_tiers(tmp_path):
    paratrain(tmp_path, "train", "--nproc", "2", "--training.steps=2", "--training.device=cpu",
              "--training.eval_every=0", "--sample.max_new_tokens=2", *TIERS)
    header = (tmp_path / "runs/default/memory-estimate.txt").read_text()  # the trainer's estimate, as it starts
    config = "runs/default/config.toml"
    estimated = paratrain(tmp_path, "estimate", "--model", config, "--world-size", "2")
    dry = paratrain(tmp_path, "train", "--config", config, "--dry-run", "--world", "2")
    line = memory_line(header)
    assert "host" in line, line  # CPU offload and activation offload put bytes in host memory
    assert memory_line(estimated) == line and memory_line(dry) == line
    assert "chunked loss (4 pieces), activation offload (every block), CPU offload" in estimated


def test_recipe_from_config_resolves_what_is_automatic():
    cfg = Config()
    cfg.training.precision = "fp32"
    cfg.memory.cpu_offload = True
    layout = Layout.resolve(4, dp_mode="fsdp", tp=2)
    recipe = Recipe.from_config(cfg, layout, micro_batch=2, accum_steps=3, device_type="cpu")
    assert recipe.optimizer_impl == "fused" and recipe.capabilities == (ChunkedLoss(0), CpuOffload())
    assert recipe.loss_chunks == 0  # (the chunked loss automatic until the model and the micro-batch are known)
    assert Recipe.from_config(cfg, layout, 2, 3, "cuda").optimizer_impl == "fused"
    cfg.training.precision = "fp16"  # torch's fused AdamW on a CPU cannot take ShardedGradScaler's found_inf
    assert Recipe.from_config(cfg, layout, 2, 3, "cpu").optimizer_impl == "foreach"
    assert Recipe.from_config(cfg, layout, 2, 3, "cuda").optimizer_impl == "fused"
    assert recipe.name.startswith("fsdp,tp=2,ac=none,mb=2") and recipe.name.endswith("cpuoff=on")
    assert recipe.replace(capabilities=()).capabilities == () and recipe.micro_steps == 3


def _calls(name: str) -> list[str]:
    """Where `name(...)` is called in paratrain/, bench/ and tests/ (file:line)."""
    out = []
    for path in [*ROOT.glob("paratrain/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_estimate_inputs_are_made_in_one_function():
    assert _calls("EstimateInputs") == ["paratrain/estimate/inputs.py:" + _calls("EstimateInputs")[0].split(":")[1]]
    assert len(_calls("EstimateInputs")) == 1


def test_optimizer_impl_rule_is_written_once():
    """`optimizer.impl = auto` is resolved by modes.resolve_impl alone (no other "fused" if ... cuda choice)."""
    pattern = re.compile(r"""["']fused["']\s+if\b""")
    found = [f"{p.relative_to(ROOT)}" for p in [*ROOT.glob("paratrain/**/*.py"), *ROOT.glob("bench/*.py")]
             if pattern.search(p.read_text())]
    assert found == ["paratrain/modes.py"], found


def test_to_config_and_from_config_are_one_mapping():
    """A recipe written into a config reads back as itself (every field, tiers and compression included)."""
    from paratrain.capabilities.lora import LoRA
    from paratrain.capabilities.grad_compression import Compression

    layout = Layout.resolve(8, dp_mode="hsdp", dp_replicate=2, tp=2)
    recipe = Recipe(layout, precision="fp16", checkpointing="every_k", every_k=3, micro_batch=4, accum_steps=2,
                    seq_len=512, optimizer="sgd", optimizer_impl="foreach",
                    compression=Compression("sign_ef", 4, 64), fsdp_backward_prefetch=2,
                    lora=LoRA(8, 32.0, 0.1, ("wq", "wv")),
                    capabilities=(ChunkedLoss(4), ActivationOffload("every_k", 3), CpuOffload()))
    cfg = recipe.to_config(Config())
    cfg.optimizer.impl = "foreach"
    assert Recipe.from_config(cfg, Layout.from_config(cfg.parallel, 8), 4, 2, "cuda") == recipe


def test_a_setting_declared_with_its_key_needs_no_other_code():
    """Adding a recipe setting is one field and its config key: reading and writing it, its command-line flag (typed
    and described from the config) and its entry in the configuration reference follow (a throwaway field, on a
    config key no recipe field has)."""
    import dataclasses

    from paratrain.recipe import setting

    Extended = dataclasses.make_dataclass("Extended", [("throwaway", float, setting("training.grad_clip"))],
                                          bases=(Recipe,), frozen=True)
    cfg = Config()
    cfg.training.grad_clip = 0.25
    read = Extended.from_config(cfg, Layout.resolve(1), 1, 1, "cpu")
    assert read.throwaway == 0.25
    assert read.replace(throwaway=0.5).to_config(Config()).training.grad_clip == 0.5

    import argparse

    from paratrain.commands.recipe_flags import add_recipe_flags, with_recipe_flags
    from paratrain.config_reference import render

    parser = argparse.ArgumentParser()
    add_recipe_flags(parser, Extended)
    assert "--grad-clip" in parser.format_help() and "--micro-batch" in parser.format_help()
    args = parser.parse_args(["--grad-clip", "0.125", "--micro-batch", "3"])
    cfg = with_recipe_flags(Config(), args, Extended)
    assert cfg.training.grad_clip == 0.125 and cfg.training.micro_batch == 3  # typed: a float and an int
    assert Extended.from_config(cfg, Layout.resolve(1), 1, 1, "cpu").throwaway == 0.125
    assert "grad_clip" in render()  # the configuration reference is generated from the config dataclasses
