"""The capability seam (paratrain/capabilities): a capability is one module, and z-loss, the seam's proof, computes
PaLM's penalty, logs it, and trains the same on every layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain import capabilities
from paratrain.capabilities.z_loss import ZLoss
from paratrain.config import load_config
from paratrain.errors import ConfigError
from paratrain.training.step import TokenLoss
from paratrain.verify import CAPABILITY_MATRICES, run_verify

ROOT = Path(__file__).resolve().parents[1]


def test_z_loss_is_palms_penalty():
    """cross-entropy + coefficient x logsumexp(logits)^2 over the target tokens (not the masked ones), for the mean
    and the sum; the step's metric is the penalty's mean per target token."""
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 11) * 3, torch.randint(0, 11, (2, 5))
    targets[0, :2] = -100
    loss = TokenLoss([ZLoss(1e-2)], torch.device("cpu"))
    loss.reset()
    loss.recording = True
    kept = targets != -100
    penalty = 1e-2 * torch.logsumexp(logits, -1)[kept].square()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss(logits, targets), ce + penalty.mean())
    torch.testing.assert_close(loss(logits, targets, "sum"), ce * kept.sum() + penalty.sum())
    assert loss.step_stats()()["z_loss"] == pytest.approx(penalty.mean().item(), rel=1e-6)
    plain = TokenLoss([], torch.device("cpu"))
    torch.testing.assert_close(plain(logits, targets), ce)


def test_z_loss_config():
    from paratrain.capabilities.chunked_loss import ChunkedLoss

    automatic = ChunkedLoss(0)  # (every default run holds the chunked loss, automatic: memory.loss_chunks=0)
    assert capabilities.active(load_config(None, [])) == (automatic,)
    assert capabilities.active(load_config(None, ["--training.z_loss=1e-4"])) == (ZLoss(1e-4), automatic)
    with pytest.raises(ConfigError, match="training.z_loss must be >= 0"):
        load_config(None, ["--training.z_loss=-1"])


def test_z_loss_rows_match_one_process(char_data):
    """The capability's verify rows (fsdp2, tp2 with loss parallel) against one process with the same z-loss."""
    rows, _ = run_verify(CAPABILITY_MATRICES["z_loss"], steps=4, tolerance=1e-5,
                         extra_args=[f"data.dir={char_data}"], echo=lambda line: None)
    assert [r.layout for r in rows if r.passed] == ["z_loss-fsdp2", "z_loss-tp2"], rows


def test_z_loss_is_logged(tmp_path, char_data):
    """`paratrain train --training.z_loss=...`: metrics.jsonl has the penalty on every logged step."""
    run = subprocess.run([sys.executable, "-m", "paratrain", "train", "--training.steps=2", "--training.log_every=1",
                          "--model.preset=tiny",
                          "--training.seq_len=32", "--training.micro_batch=2", "--training.z_loss=1e-3",
                          f"--data.dir={char_data}", f"--run.out_dir={tmp_path}", "--sample.max_new_tokens=0",
                          "--training.eval_every=0", "--checkpoint.save_final=false", "--metrics.progress=none"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["z_loss"] for r in records if "loss" in r]
    assert len(logged) == 2 and all(0 < z < 1 for z in logged), records


# Where a capability's name may appear in the package beside its module and its registration, and why.
NAMED_ALSO_IN = {
    "z_loss": set(),
    "diloco": set(),
    "moe_balancing": set(),  # (auxiliary-loss-free balancing, `[moe]`: grepped by NAME_PATTERN's words)
    "float8": {"paratrain/estimate/profile.py"},  # (the FP8 curve's name in calibration profiles saved before)
    "adamw8bit": {"paratrain/training/optim.py"},  # (its builder, imported into the builders' table)
    "muon": {"paratrain/training/muon.py", "paratrain/training/optim.py"},  # (its kernels; their builders' table)
    "cpu_offload": {"paratrain/training/checkpoint.py"},  # (torch's StateDictOptions(cpu_offload=True), not ours)
    # (its runtime, the saved-tensor hooks, a torch module that parallelize applies to the blocks it names: the
    # capabilities package may not import distributed/, which imports it)
    "activation_offload": {"paratrain/distributed/offload.py", "paratrain/distributed/parallelize.py"},
    # (their kernels, a torch module; their builders' table. Their entries and MomentumSchedule are the module's: the
    # run's GradComm gets the schedule from the entry's `schedule` factory, handed over by the trainer)
    "onebit": {"paratrain/training/onebit.py", "paratrain/training/optim.py"},
    # Its value type, `Compression`, is a field of every Recipe and of the planner's Context (`none` included), so the
    # modules that build or read those name its module: the Recipe, the planner's flags and Context, `estimate`'s
    # flags, evaluation (no compression), Muon (refuses sign_ef's 1-bit gradients). Besides: the optimizer's check
    # against the method (config.py, with the optimizer's other checks, in their order), the run's layout check
    # (spec.py), the [parallel] flags plan and estimate share (layout_grammar.py), the plan JSON's key (plan.py), and
    # its runtime (distributed/compression.py's GradComm: the torch hooks, which take the torch-free decisions from it)
    "grad_compression": {"paratrain/recipe.py", "paratrain/estimate/planner.py", "paratrain/estimate/step_time.py",
                         "paratrain/commands/estimate.py", "paratrain/downstream.py", "paratrain/capabilities/muon.py",
                         "paratrain/config.py", "paratrain/spec.py", "paratrain/layout_grammar.py",
                         "paratrain/commands/plan.py", "paratrain/distributed/compression.py",
                         "paratrain/capabilities/diloco.py",  # (refused with dp_sync=diloco: no per-step reduction)
                         # (a PowerSGD run's gloo groups keep two worker threads: distributed/gloo_workers.py)
                         "paratrain/api.py"},
    "lora": {
        # the capabilities that refuse it (a conflict names both; each refusal stays with the capability that cannot
        # run with frozen adapters: fp8's casts of the frozen base, Muon's hidden matrices)
        "paratrain/capabilities/float8.py", "paratrain/capabilities/muon.py",
        # the models layer, which the capabilities import (so it takes the LoRA value and imports nothing of it): the
        # adapted parameter table (torch-free) and LoRALinear / apply_lora, the adapters' init (llama.py) and the
        # parameter table's `trainable` flag (family.py)
        "paratrain/models/lora_params.py", "paratrain/models/lora.py", "paratrain/models/llama.py",
        "paratrain/models/family.py",
        # the value on a Recipe (`Recipe.lora`) and a RunSpec (the checkpoint's adapters and base): fields the seam
        # does not replace
        "paratrain/recipe.py", "paratrain/spec.py",
        # the estimator's parameter accounting (`adapted_params`: adapters trainable, the base frozen) and what it
        # says of it: model states, step time (no weight gradients for a frozen base), activations (the base stored
        # in the compute dtype), the planner's search, the report's lines, its inputs' check; the step's hidden
        # matrices and the dry run's comparison ask the same table
        "paratrain/estimate/model_states.py", "paratrain/estimate/core.py", "paratrain/estimate/step_time.py",
        "paratrain/estimate/activations.py", "paratrain/estimate/search.py", "paratrain/estimate/report.py",
        "paratrain/estimate/inputs.py", "paratrain/training/step.py", "paratrain/training/dryrun.py",
        # a checkpoint of adapters only (and the base it names), loaded at every start (loop.py: the base from its
        # folder, the run's header line), outside its run (adapters.py: generation, downstream evaluation,
        # inference), exported merged into the base (export.py, hf/) or as a PEFT adapter folder (peft_export.py),
        # and an imported Hugging Face model's weights less the adapters (hf/load.py)
        "paratrain/training/checkpoint.py", "paratrain/training/loop.py", "paratrain/training/adapters.py",
        "paratrain/downstream.py", "paratrain/inference.py", "paratrain/training/export.py",
        "paratrain/training/peft_export.py", "paratrain/commands/export.py", "paratrain/hf/__init__.py",
        "paratrain/hf/load.py",
    },
    # segment checkpointing (capabilities/segment_checkpointing.py), grepped by its word:
    "segment": {
        # a value of the one `activation_checkpoint.mode` setting: CheckpointMode.SEGMENTS and the questions the cost
        # model asks of every mode (how much it recomputes, whether it stores at least another's); every_k's key
        # comment contrasts the two (docs/configuration.md, generated from it); activation offload refuses it (its
        # hooks would sit inside a segment's checkpoint)
        "paratrain/modes.py", "paratrain/config.py", "paratrain/capabilities/activation_offload.py",
        # another meaning of the word: the CUDA caching allocator's memory segments (`expandable_segments`, its
        # settings' names, and the snapshot's "segments" the doctor reads)
        "paratrain/allocator.py", "paratrain/observe/doctor.py",
        # `Recipe.segment_blocks`, the field the planner's candidates set (`Recipe.replace(segment_blocks=)`, with the
        # checkpointing mode's capability implied again), and the candidates' plain attribute of it (step_time.py's
        # `Candidate.segment_blocks`, beside every_k and micro_batch); the layout grammar's
        # documented `ac=segmentsK` and its error message, and the settings a built-in mode's `ac=` resets
        "paratrain/recipe.py", "paratrain/estimate/step_time.py", "paratrain/layout_grammar.py",
        # the estimator: the bytes a recomputed segment holds (`segment_recomputed`, on the estimator's ActDims, which
        # the capabilities may not import) and the walk's recomputation of a unit in its last block's backward, the
        # JSON's `segment_blocks` of every estimate, the `--segment-blocks` flag's check among the others
        "paratrain/estimate/activations.py", "paratrain/estimate/core.py", "paratrain/estimate/inputs.py",
        # its runtime: CheckpointedSegment, torch hooks that parallelize applies to the units `checkpoint_units` names
        # (the capabilities may not import distributed/)
        "paratrain/distributed/parallelize.py",
        # the word's other meanings: metrics.jsonl's segment records (metrics.py, loop.py), the CUDA allocator's
        # segments (oom.py), a packed sequence's documents (packing.py), a flat gradient buffer's pieces
        # (compression.py)
        "paratrain/observe/metrics.py", "paratrain/training/loop.py", "paratrain/observe/oom.py",
        "paratrain/data/packing.py", "paratrain/distributed/compression.py",
    },
    # The chunked loss, named by its key (`memory.loss_chunks`, the JSON documents' `memory_tiers` name), in
    # capabilities/chunked_loss.py. Its runtime is the model's forward (`targets=, loss_chunks=`: llama.py's
    # chunked_cross_entropy; family.py's forward contract): the models layer, which may not import capabilities, takes
    # the count as a plain argument, and the trainer (training/step.py) passes it, resolved per micro-batch through
    # the hook, and builds a step without a recipe with it automatic. The planner's Candidate keeps it as a plain
    # attribute for its inner loops, and `Candidate.of` starts a run's automatic (0) at one piece (step_time.py).
    "loss_chunks": {"paratrain/models/llama.py", "paratrain/models/family.py", "paratrain/training/step.py",
                    "paratrain/estimate/step_time.py"},
}
# A capability's module where it is not named after it (its entry above is keyed by another word: segment
# checkpointing by its word, the chunked loss by its key, `loss_chunks`).
MODULE_OF = {"segment": "segment_checkpointing", "loss_chunks": "chunked_loss"}
# A capability's word where another meaning of it is not the capability: DeepSeek's latent attention ranks
# (`q_lora_rank`, `kv_lora_rank`: its config.json's names) are no low-rank adapters.
# Auxiliary-loss-free balancing by its module's name (the registry imports it) or its own key (its module).
NAME_PATTERN = {"lora": r"(?<!q_)(?<!kv_)lora", "moe_balancing": "moe_balancing|bias_update_rate"}


@pytest.mark.parametrize("name", sorted(NAMED_ALSO_IN))
def test_a_capability_is_named_in_its_module_and_its_registration_only(name):
    """A capability's name appears in its module and the registry (and the few places NAMED_ALSO_IN says why),
    nowhere else in the package: the trainer, the estimator, the planner, verify and the checkpoint iterate over the
    registered capabilities. (z-loss was added through the seam.)"""
    found = subprocess.run(["grep", "-rliP", NAME_PATTERN.get(name, name), "paratrain", "--include=*.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    module = f"paratrain/capabilities/{MODULE_OF.get(name, name)}.py"
    assert set(found) == {"paratrain/capabilities/__init__.py", module, *NAMED_ALSO_IN[name]}


def test_a_capabilitys_plan_flag_and_json_key(tmp_path):
    """fp8's `paratrain plan --float8` comes from its module (`Capability.plan_flag`): the same plan as --precision
    fp8, and the JSON's "float8" key says so."""
    plans = []
    for i, flags in enumerate((["--float8"], ["--precision", "fp8"], [])):
        out = subprocess.run([sys.executable, "-m", "paratrain", "plan", "--model", "llama3-8b", "--gpus", "8",
                              "--gpu", "H100", "--seq", "4096", "--global-batch-tokens", "1048576", "--top", "1",
                              "--json", "--out", f"plan{i}", *flags], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
        plans.append(json.loads(out))
    for plan in plans:
        plan.pop("planning_seconds"), plan.pop("written")
    assert plans[0] == plans[1] and plans[0]["float8"] and plans[0]["precision"] == "fp8"
    assert not plans[2]["float8"] and plans[2]["precision"] == "bf16"


def test_profiles_saved_with_the_old_fp8_curve_name_load(tmp_path):
    from paratrain.estimate.hardware import gpu_profile, load_profile

    saved = gpu_profile("H100").to_json()
    saved["float8_gemm"] = saved.pop("fp8_gemm")
    (tmp_path / "old.json").write_text(json.dumps(saved))
    loaded = load_profile("old", tmp_path)
    assert loaded.fp8_gemm and loaded.fp8_gemm == gpu_profile("H100").fp8_gemm


def test_checkpoint_state_unwraps_what_a_capability_wraps():
    """`capabilities.checkpoint_state`: fp8's float8 all-gather weight wrapper becomes the plain tensor it wraps
    (sharing its storage); plain tensors pass through."""
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    plain = torch.randn(4, 4)
    wrapped = WeightWithDynamicFloat8CastTensor(plain, LinearMMConfig(), torch.float8_e4m3fn)
    state = {"model": {"w": wrapped, "b": torch.zeros(2)}, "step": 3}
    out = capabilities.checkpoint_state(state)
    assert type(out["model"]["w"]) is torch.Tensor and out["model"]["w"].data_ptr() == plain.data_ptr()
    assert out["model"]["b"] is state["model"]["b"] and out["step"] == 3


def test_segment_checkpointing_is_held_exactly_when_the_mode_is_segments():
    """A Recipe holds segment checkpointing's capability exactly when its checkpointing mode is segments, with its
    segment_blocks, however it was made or replaced (Recipe.replace's fast path: the planner's candidates), and its
    units, label and words follow."""
    from paratrain.capabilities.segment_checkpointing import SegmentCheckpointing
    from paratrain.layout import Layout
    from paratrain.modes import CheckpointMode
    from paratrain.recipe import Recipe

    def held(recipe):
        return [c for c in recipe.capabilities if isinstance(c, SegmentCheckpointing)]

    plain = Recipe(Layout.resolve(1))
    seg = plain.replace(checkpointing=CheckpointMode.SEGMENTS, segment_blocks=3)
    assert held(plain) == [] and held(seg) == [SegmentCheckpointing(3)]
    assert held(Recipe(Layout.resolve(1), checkpointing="segments")) == [SegmentCheckpointing(0)]
    assert held(seg.replace(segment_blocks=0)) == [SegmentCheckpointing(0)]
    assert held(seg.replace(checkpointing=CheckpointMode.FULL)) == [] and held(seg.replace(micro_batch=2)) == held(seg)
    assert "ac=segments3" in seg.name and "ac=segments," in seg.replace(segment_blocks=0).name
    assert capabilities.checkpoint_units(seg.capabilities, [4, 5, 6, 7], 8) == [[4, 5, 6], [7]]
    assert capabilities.checkpoint_units(plain.capabilities, [4, 5], 8) == [[4], [5]]
    assert SegmentCheckpointing(0).describe_checkpointing(32) == "segments (k=6)"
    assert SegmentCheckpointing.parse_checkpointing_label("segments0") is None


def test_the_chunked_loss_is_a_recipe_setting_by_name():
    """The chunked loss is a capability a Recipe holds where its count is not 1 and gives by name
    (`Capability.recipe_setting`): `recipe.loss_chunks`, `Recipe.replace(loss_chunks=)` (the planner's fast path keeps
    the registry's order), its config key and its layout item, the same value each way."""
    import pickle

    from paratrain.capabilities.chunked_loss import ChunkedLoss
    from paratrain.capabilities.cpu_offload import CpuOffload
    from paratrain.config import Config
    from paratrain.estimate.step_time import Candidate
    from paratrain.layout import Layout
    from paratrain.recipe import Recipe

    fsdp = Layout.resolve(2, dp_mode="fsdp")
    plain = Recipe(fsdp, precision="fp32", capabilities=(CpuOffload(),))
    assert plain.loss_chunks == 1 and ChunkedLoss not in map(type, plain.capabilities)
    chunked = plain.replace(loss_chunks=8, micro_batch=2)
    assert chunked.capabilities == (ChunkedLoss(8), CpuOffload()) and chunked.loss_chunks == 8
    assert chunked == Recipe(fsdp, precision="fp32", micro_batch=2, capabilities=(CpuOffload(), ChunkedLoss(8)))
    assert chunked.replace(loss_chunks=1) == plain.replace(micro_batch=2)
    assert chunked.name.endswith("loss=8,cpuoff=on") and pickle.loads(pickle.dumps(chunked)) == chunked
    assert Candidate(chunked).loss_chunks == 8 and Candidate.of(plain.replace(loss_chunks=0)).loss_chunks == 1
    for value in (0, 1, 8):
        cfg = Recipe(fsdp).replace(loss_chunks=value).to_config(Config())
        assert cfg.memory.loss_chunks == value
        assert Recipe.from_config(cfg, fsdp, 1, 1, "cpu").loss_chunks == value
    with pytest.raises(AttributeError):
        plain.no_such_setting
