"""The recipe: everything that says how a model is trained on a world, apart from the model and the data.

One frozen, torch-free value, resolved (automatic choices made): the layout (degrees, data-parallel mode, pipeline
schedule), activation checkpointing, the batch shape per rank (micro-batch, accumulation, sequence length),
precision (and TF32), the optimizer entry and its kernels, gradient compression, FSDP's prefetching, LoRA,
compilation, and the capabilities the run uses (paratrain/capabilities: fp8, z-loss, ...) with their settings.

    recipe = Recipe.from_config(cfg, layout, micro_batch, accum_steps, device_type)   # a run's config, read once
    recipe.name                                                                        # fsdp,tp=2,ac=full,mb=1,loss=8

The estimator (`paratrain.estimate.inputs.inputs_for`: model, recipe, target) reads a run's memory from it, so the
trainer's header, `paratrain estimate --model RUN/config.toml`, the dry run and the OOM report ask the same question.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from paratrain import capabilities
from paratrain.capabilities.base import Capability
from paratrain.config import Config
from paratrain.errors import UserError
from paratrain.layout import Batch, Layout
from paratrain.layout_grammar import layout_name
from paratrain.capabilities.grad_compression import Compression
from paratrain.capabilities.lora import LoRA
from paratrain.modes import CHECKPOINT_MODES, PRECISIONS, CheckpointMode, OptimizerImpl, Precision, resolve_impl


def _get(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


_CONFIG_DEFAULTS = Config()  # (a run's config as `paratrain train` starts from it: the keyed fields' defaults)


def config_default(key: str):
    """The default of a config key ("section.key"), as paratrain/config.py declares it."""
    return _get(_CONFIG_DEFAULTS, key)


NO_FLAG = ""  # a setting's `flag` when no command takes it as a flag


def setting(key: str, flag: str | None = None):
    """A recipe field read from and written to one config key ("section.key"), whose default is the config's (the
    key is declared once, in paratrain/config.py): declaring it here is all `Recipe.from_config`, `Recipe.to_config`
    and the commands' flags (`recipe_settings`) need. `flag`: its command-line name where that is not the key's own
    (`--` and the key with dashes; NO_FLAG: none)."""
    return field(default=config_default(key), metadata={"key": key, **({"flag": flag} if flag is not None else {})})


@dataclass(frozen=True)
class Recipe:
    layout: Layout  # [parallel]'s degrees and schedule (Layout.from_config / to_config); validated where it comes
    # from a run (pp_split, microbatches)
    precision: Precision = setting("training.precision")
    tf32: bool | None = setting("training.tf32")  # fp32 matmuls on TF32 tensor cores (unset: modes.tf32_on)
    checkpointing: CheckpointMode = setting("activation_checkpoint.mode", "--checkpointing")
    every_k: int = setting("activation_checkpoint.every_k")
    segment_blocks: int = setting("activation_checkpoint.segment_blocks")  # 0: round(sqrt(n_layers))
    micro_batch: int = setting("training.micro_batch")  # sequences per micro-step and rank (per pipeline
    # micro-batch with pp > 1)
    accum_steps: int = 1  # micro-steps per optimizer step (pp > 1: layout.pp_microbatches instead); from the batch
    seq_len: int = setting("training.seq_len")
    optimizer: str = setting("optimizer.name", "--optimizer")  # an entry of the optimizer table
    optimizer_impl: OptimizerImpl = "fused"  # optimizer.impl resolved on the run's device (modes.resolve_impl)
    compression: Compression = field(default_factory=Compression)  # [parallel]'s grad_compression and its settings
    fsdp_backward_prefetch: int = setting("parallel.fsdp_backward_prefetch")
    # the gradient communication's buckets and FSDP's forward prefetching (no command-line flag: neither the layout
    # nor its memory; the planner's DDP buckets are `paratrain plan --ddp-bucket-mb`, a [parallel] flag)
    fsdp_forward_prefetch: int = setting("parallel.fsdp_forward_prefetch", NO_FLAG)
    ddp_bucket_mb: float = setting("parallel.ddp_bucket_mb", NO_FLAG)
    lora: LoRA | None = None  # [lora]
    # each block compiled (a backend's name: that backend), its blocks replaying CUDA graphs (no estimate/plan flag:
    # `plan --compile` is the planner's request)
    compile: bool | str = setting("training.compile", NO_FLAG)
    cuda_graphs: bool = setting("training.cuda_graphs", NO_FLAG)
    # checkpoints written in the background: their staging copy of the rank's state is host memory (no flag: not a
    # layout, the estimate of a run's config reads it)
    async_save: bool = setting("checkpoint.async_save", NO_FLAG)
    capabilities: tuple[Capability, ...] = ()  # the run's, with their settings (capabilities.active): the memory
    # tiers too (the chunked loss: its pieces read and replaced by name, 0 automatic until the model is known)

    def __post_init__(self):
        # the capabilities its other settings imply (Capability.implied_by), with their defaults
        if self.precision not in PRECISIONS:  # (a config's or a flag's name, coerced)
            raise UserError(f"--precision '{self.precision}' is not one of {', '.join(PRECISIONS)}")
        object.__setattr__(self, "precision", Precision(self.precision))
        if self.checkpointing not in CHECKPOINT_MODES:
            raise UserError(f"--checkpointing '{self.checkpointing}' is not one of {', '.join(CHECKPOINT_MODES)}")
        object.__setattr__(self, "checkpointing", CheckpointMode(self.checkpointing))
        object.__setattr__(self, "capabilities", capabilities.implied(self, self.capabilities))

    def __getattr__(self, name: str):
        """A capability's setting by its name (`Capability.recipe_setting`: the chunked loss's pieces, 1 where the
        recipe holds none)."""
        if name not in capabilities.SETTINGS:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return capabilities.setting(self.capabilities, name)

    @classmethod
    def from_config(cls, cfg, layout: Layout, micro_batch: int, accum_steps: int, device_type: str) -> "Recipe":
        """A run's config (paratrain.config.Config) on its validated layout and batch: the one reading of the
        sections a recipe is made of. `micro_batch` is what one micro-step runs (a pipeline's micro-batch)."""
        values = {f.name: _get(cfg, f.metadata["key"]) for f in _keyed_fields(cls)}
        return cls(layout, **{**values, "micro_batch": micro_batch}, accum_steps=accum_steps,
                   optimizer_impl=resolve_impl(cfg.optimizer.impl, device_type, cfg.training.precision,
                                                cfg.optimizer.name),
                   compression=Compression.from_config(cfg.parallel), lora=LoRA.from_config(cfg),
                   capabilities=capabilities.active(cfg))

    @classmethod
    def of_run(cls, cfg, layout: Layout, global_batch: int, accum_steps: int, device_type: str) -> "Recipe":
        """`from_config` for a run's global batch: a pipeline cuts each data-parallel rank's batch into the layout's
        microbatches (no accumulation loop), the others run `training.micro_batch` sequences per micro-step."""
        t = cfg.training
        micro = layout.forward_batch(Batch(global_batch, t.micro_batch, t.seq_len))
        return cls.from_config(cfg, layout, micro, accum_steps, device_type)

    def to_config(self, cfg):
        """`cfg` (a paratrain.config.Config, changed in place and returned) running this recipe: every field written
        to its section (the layout with every degree); optimizer.impl and the global batch are the caller's."""
        for f in _keyed_fields(self):
            section, key = f.metadata["key"].split(".")
            setattr(getattr(cfg, section), key, getattr(self, f.name))
        cfg.parallel = dataclasses.replace(self.layout.to_config(cfg.parallel), **self.compression.config_values())
        for key, value in capabilities.switch_values(self.capabilities).items():  # (the switches' keys: [memory])
            _set(cfg, key, value)
        cfg.training.accum_steps = self.accum_steps
        for capability in self.capabilities:  # the others' keys (a recipe field's: the adapters' [lora])
            for key, value in capability.config_values().items() if not capability.layout_item else ():
                _set(cfg, key, value)
        return cfg

    @property
    def name(self) -> str:
        """The layout grammar's one name (paratrain/layout_grammar.py) with checkpointing, micro-batch and tiers."""
        return layout_name(self.layout, self.checkpointing, self.every_k, self.micro_batch, switched=self.capabilities)

    @property
    def micro_steps(self) -> int:
        """Micro-batches per rank and optimizer step: the pipeline's, else the accumulation steps."""
        return self.layout.pp_microbatches if self.layout.pipelined else self.accum_steps

    def replace(self, **changes) -> "Recipe":
        """A changed copy; a capability's setting by its name (`Capability.recipe_setting`: the chunked loss's
        pieces)."""
        if changes.keys() <= _PLAIN_FIELDS:  # (the planner's candidates, below, with nothing implied: the fast way)
            copy = object.__new__(type(self))
            copy.__dict__.update(self.__dict__, **changes)
            return copy
        shape = _SHAPE_FIELDS
        named = changes.keys() & capabilities.SETTINGS.keys()
        if named:
            shape = (_SHAPE_FIELDS | {"capabilities"}) if "capabilities" not in changes else shape
            for name in named:
                changes["capabilities"] = capabilities.with_setting(changes.get("capabilities", self.capabilities),
                                                                    name, changes.pop(name))
        if changes.keys() <= shape and isinstance(changes.get("checkpointing", CheckpointMode.NONE), CheckpointMode):
            # (the planner's candidates: tens of thousands per plan) nothing to coerce, and no capability implied
            # anew but a checkpointing mode's: `Capability.implied_by` reads only the precision and the optimizer
            # (capabilities.Settings), and a setting's capability (`with_setting`) implies none and keeps the
            # registry's order
            copy = object.__new__(type(self))
            copy.__dict__.update(self.__dict__, **changes)
            if not _CHECKPOINTING_FIELDS.isdisjoint(changes):  # (a checkpointing mode that is a capability)
                copy.__dict__["capabilities"] = capabilities.implied_checkpointing(copy, copy.capabilities)
            return copy
        return dataclasses.replace(self, **changes)


# The fields a candidate layout changes, which `Recipe.replace` sets without `__post_init__` (those that decide a
# checkpointing mode's capability, `Capability.checkpoint_mode`, with its capabilities implied again).
_SHAPE_FIELDS = frozenset({"layout", "checkpointing", "every_k", "segment_blocks", "micro_batch", "accum_steps"})
_CHECKPOINTING_FIELDS = frozenset({"checkpointing", "segment_blocks"})
_PLAIN_FIELDS = _SHAPE_FIELDS - _CHECKPOINTING_FIELDS - capabilities.SETTINGS.keys()


def setting_keys(recipe=Recipe) -> dict[str, str]:
    """{a setting as the Recipe names it: its config key ("section.key")} of every setting a recipe reads from a
    run's config: the recipe's own keyed fields and the keys of the capabilities a layout's name switches on (the
    memory tiers, `[memory]`: the chunked loss's, activation offload's, CPU offload's). The layout's `[parallel]` keys
    are Layout's (`Layout.from_config`)."""
    return {name: key for name, key, _ in _settings(recipe)}


def recipe_settings(recipe=Recipe) -> dict[str, str]:
    """{config key: its command-line flag} of `setting_keys`' settings (a field may name its flag). The layout's
    `[parallel]` keys have theirs in layout_grammar (`FLAG_KEYS`)."""
    return {key: flag or "--" + key.split(".")[1].replace("_", "-") for _, key, flag in _settings(recipe)
            if flag != NO_FLAG}


def _settings(recipe) -> list[tuple[str, str, str | None]]:
    """(name, config key, flag or None) of each setting a recipe reads from a run's config."""
    out = [(f.name, f.metadata["key"], f.metadata.get("flag")) for f in _keyed_fields(recipe)]
    return out + [(f.name, f"{cls.adds_to[0]}.{f.name}", f.metadata.get("flag")) for cls in capabilities.switches()
                  for f in dataclasses.fields(cls.adds_to[1])]


def _keyed_fields(recipe) -> list:
    return [f for f in dataclasses.fields(recipe) if "key" in f.metadata]


def _set(cfg, key: str, value) -> None:
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
