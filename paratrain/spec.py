"""Resolving a run: config + world size (+ the prepared data's vocabulary) -> a `RunSpec`, once per process.

Everything that can be decided before a process group or a model exists is decided here, and every rule it
applies lives in one place: the layout's in `paratrain/layout.py`, the config's in `paratrain/config.py`, the
model's dimensions in `model_args_from`. The launcher resolves before starting ranks (so bad input is one line
before anything starts); each rank resolves again from the same config and the prepared data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from paratrain import memory
from paratrain.config import Config
from paratrain.errors import ConfigError, UserError
from paratrain.layout import Batch, Layout, grad_compression_site
from paratrain.optimizers import optimizer_entry
from paratrain.models.args import ModelArgs
from paratrain.models.presets import preset_args, preset_fields

VOCAB_PAD = 64  # pad small vocabularies so embedding/output split evenly over tensor-parallel ranks


@dataclass(frozen=True)
class RunSpec:
    """What a run is, decided before any process group or model exists."""

    cfg: Config
    layout: Layout  # validated against the model and the batch; pipeline microbatches and split filled in
    model_args: ModelArgs
    data_dir: Path
    global_batch: int  # sequences per optimizer step
    accum_steps: int  # micro-steps per optimizer step (1 with a pipeline)
    batch_fixed: str  # which of global batch / accumulation the user fixed

    @property
    def model_name(self) -> str:
        return model_name(self.cfg)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.cfg.training.seq_len


def model_name(cfg) -> str:
    """What the run trains, for headers and tables: the preset's name, or `hf:PATH (LlamaForCausalLM)` for an
    imported Hugging Face model (whose architecture replaces the preset)."""
    if cfg.model.init_from:
        from paratrain import hf

        return f"{cfg.model.init_from} ({hf.architecture(hf.init_folder(cfg))})"
    return cfg.model.preset


def model_args_from(cfg, data_vocab: int | None = None) -> ModelArgs:
    """The model's dimensions from a config (`config.Config`): an imported Hugging Face model's config.json, or the
    preset, then the `[model]` overrides.

    The vocabulary is `model.vocab_size` when set, else the preset's, else the data's (`data_vocab`, the
    tokenizer's size) padded to a multiple of VOCAB_PAD. data_vocab=None (no data prepared): a preset that takes its
    vocabulary from the data then needs `model.vocab_size`, or it is a ConfigError. The sequence length is checked
    against max_seq_len with the batch, by `Layout.validate`."""
    m = cfg.model
    if m.init_from:  # a Hugging Face model: architecture and exact vocabulary from its config.json
        from paratrain import hf

        args = hf.model_args(cfg)
    else:
        # every model key but the preset's name and the vocabulary (dimensions, rope, norm, moe_* settings)
        overrides = {k: v for k, v in vars(m).items() if k not in ("preset", "vocab_size", "init_from")}
        vocab = m.vocab_size
        if vocab is None and data_vocab is not None:
            vocab = math.ceil(data_vocab / VOCAB_PAD) * VOCAB_PAD
        if vocab is None and preset_fields(m.preset)["vocab_size"] is None:
            raise ConfigError(f"model preset '{m.preset}' takes its vocab size from the dataset: set model.vocab_size")
        args = preset_args(m.preset, vocab_size=vocab, **overrides)
        if data_vocab is not None and args.vocab_size < data_vocab:
            raise ConfigError(f"model vocab size {args.vocab_size} is smaller than the dataset's {data_vocab}")
    if cfg.checkpoint.export_hf:  # the export at the end must be possible: checked before training
        from paratrain.hf import check_run

        check_run(cfg, args)
    if (m.head_dim is None and not m.init_from and args.dim % args.n_heads) or args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}: "
                          "dim must divide by n_heads (or set model.head_dim) and n_heads by n_kv_heads")
    return args


def batch_of(cfg: Config, layout: Layout) -> tuple[Batch, str]:
    """The batch the layout must divide, and which of global batch / accumulation the user fixed."""
    t = cfg.training
    if t.global_batch is not None:
        return Batch(t.global_batch, t.micro_batch, t.seq_len), "global batch fixed; accumulation derived"
    return (Batch(t.micro_batch * t.accum_steps * layout.dp, t.micro_batch, t.seq_len),
            "accumulation fixed; global batch derived")


def check(cfg: Config, world_size: int) -> Layout:
    """Every check that needs neither the data nor a process: run before preparing data or launching ranks.
    The vocabulary is a placeholder divisible by tp, so only the vocabulary checks wait for the data."""
    layout = Layout.from_config(cfg.parallel, world_size)
    return _validated(cfg, layout, model_args_from(cfg, VOCAB_PAD * layout.tp), world_size)


def resolve(cfg: Config, world_size: int, data_meta: dict) -> RunSpec:
    """The whole run, validated against the world size and the prepared data (its meta: vocabulary, and the
    folder holding the tokenizer)."""
    layout = Layout.from_config(cfg.parallel, world_size)
    batch, fixed = batch_of(cfg, layout)
    args = model_args_from(cfg, data_meta["vocab_size"])
    layout = _validated(cfg, layout, args, world_size)
    data_dir = Path(data_meta.get("dir", cfg.data.dir))
    return RunSpec(cfg, layout, args, data_dir, batch.global_batch, layout.accumulation(batch), fixed)


def _validated(cfg: Config, layout: Layout, args: ModelArgs, world_size: int) -> Layout:
    layout.check_checkpointing(cfg.activation_checkpoint.mode)
    memory.check(cfg.memory, layout, cfg.training.precision)  # the memory tiers the layout can use
    stage_gpus(cfg, layout)
    if layout.pipelined and cfg.checkpoint.export_safetensors:
        raise ConfigError("checkpoint.export_safetensors is not supported with parallel.pp > 1 yet "
                          "(the DCP checkpoint loads on any layout)")
    grad_compression_site(layout, cfg.parallel.grad_compression)  # where compression applies, or a ConfigError
    optimizer_entry(cfg.optimizer.name).check_layout(layout)  # the layouts the optimizer refuses
    return layout.validate(args, world_size, batch_of(cfg, layout)[0])


def stage_gpus(cfg: Config, layout: Layout) -> list[str]:
    """`parallel.pp_stage_gpus`: the GPU type each pipeline rank runs on (empty: not given). ConfigError unless it
    names one type per pipeline rank."""
    text = cfg.parallel.pp_stage_gpus.strip()
    if not text:
        return []
    names = [x.strip() for x in text.split(",")]
    if layout.pp == 1 or len(names) != layout.pp or not all(names):
        raise ConfigError(f"parallel.pp_stage_gpus='{text}' must name one GPU type per pipeline rank "
                          f"(parallel.pp={layout.pp})")
    return names


def data_source(cfg: Config) -> Path | None:
    """data.source as a path; None when not given, except for the default data folder, which holds the bundled
    corpus."""
    from paratrain.config import DEFAULT_DATA_DIR
    from paratrain.data import DEFAULT_CORPUS

    source = cfg.data.source
    if source is None and Path(cfg.data.dir) == Path(DEFAULT_DATA_DIR):
        source = "tinyshakespeare"
    if source is None:
        return None
    return DEFAULT_CORPUS if source == "tinyshakespeare" else Path(source)


def prepare_data(cfg: Config) -> dict:
    """Use the dataset in data.dir, or prepare it there when the folder is empty (or check a mixture's datasets);
    returns the meta, whose "dir" holds the tokenizer."""
    import sys

    from paratrain.data import prepare_for_config

    tokenizer, name = None, "data.tokenizer"
    if cfg.model.init_from:  # an imported Hugging Face model reads the ids of its own tokenizer
        from paratrain import hf

        tokenizer, name = str(hf.dataset_tokenizer(cfg)), f"the tokenizer of model.init_from ({cfg.model.init_from})"
    meta = prepare_for_config(cfg.data, data_source(cfg), tokenizer, name,
                              echo=lambda text: print(text, file=sys.stderr, flush=True))
    if cfg.model.init_from:
        hf.check_dataset(cfg, cfg.data.dir)
    return meta


def resolve_run(cfg: Config, world_size: int) -> RunSpec:
    """Check the config, prepare the data (first use only), and resolve: what a launcher does before starting ranks."""
    check(cfg, world_size)
    return resolve(cfg, world_size, prepare_data(cfg))


def model_from(spec: str, vocab_size: int | None = None,
               overrides: dict | None = None) -> tuple[str, ModelArgs, Config | None]:
    """(name, ModelArgs, the config or None) for a `--model` argument, as `paratrain estimate` and `paratrain plan`
    read it: a preset name, or a config TOML (its [model] section: a run's config.toml, plan/config.toml; with
    model.init_from = "hf:PATH", the Hugging Face folder's architecture).

    `overrides` (model dimensions; None values are unset) replace the preset's or the config's [model] values; the
    config is returned with them. `vocab_size` (--vocab-size) is the vocabulary of a model that takes it from the
    data (a preset without one, a config without model.vocab_size); without it a config's prepared data (data.dir)
    gives it, as the trainer's."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if not (spec.endswith(".toml") or Path(spec).is_file()):
        try:
            return spec, preset_args(spec, vocab_size=vocab_size, **overrides), None
        except TypeError as e:  # an override the model does not have
            raise UserError(f"--model {spec}: {e}") from None
    import dataclasses

    from paratrain.config import load_config

    cfg = load_config(spec)
    for key, value in overrides.items():
        setattr(cfg.model, key, value)
    resolved, data_vocab = cfg, None
    if cfg.model.vocab_size is None and vocab_size is not None:
        resolved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    elif cfg.model.vocab_size is None and (Path(cfg.data.dir) / "meta.json").is_file():
        # a preset that takes its vocabulary from the data (a run's config): the prepared data's, as the trainer's
        from paratrain.data.prepare import read_meta

        data_vocab = read_meta(cfg.data.dir)["vocab_size"]
    try:
        return f"{Path(spec).name} ({cfg.model.preset})", model_args_from(resolved, data_vocab), cfg
    except UserError as e:
        if "takes its vocab size from the dataset" in str(e):
            raise UserError(f"{e} (or --vocab-size N), or prepare data.dir={cfg.data.dir}") from None
        raise
