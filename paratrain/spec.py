"""Resolving a run, once per process: the config is read once into the parts later code receives, then completed
with the prepared data's vocabulary into a `RunSpec`.

    parts = check(cfg, world_size)         # no data, no process: the model's source (a preset or a Hugging Face
                                           # folder), the layout, the data source, the run folder; all checked
    meta = prepare_data(parts.data)        # first use only: prepare data.dir (or check a mixture's datasets)
    spec = resolve(parts, meta)            # the model's dimensions with the data's vocabulary, the validated
                                           # layout and the batch

Every rule applied lives in one place: the layout's in `paratrain/layout.py`, the config's in `paratrain/config.py`,
the model's dimensions in `ModelSource.args`, the run folder's in `paratrain/preflight.py`. The launcher resolves
before starting ranks (so bad input is one line before anything starts); each rank resolves again from the same
config and the prepared data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from paratrain import capabilities, hf
from paratrain.config import Config, DataConfig, DEFAULT_DATA_DIR, ModelConfig, load_config
from paratrain.data import DEFAULT_CORPUS
from paratrain.capabilities import optimizer_entry
from paratrain.errors import ConfigError, UserError
from paratrain.hf import check_run
from paratrain.capabilities.grad_compression import grad_compression_site
from paratrain.layout import Batch, Layout
from paratrain.models.args import ModelArgs
from paratrain.capabilities.lora import LoRA
from paratrain.models.presets import preset_args, preset_fields
from paratrain.preflight import RunFolder
from paratrain.recipe import Recipe

VOCAB_PAD = 64  # pad small vocabularies so embedding/output split evenly over tensor-parallel ranks


@dataclass(frozen=True)
class ModelSource:
    """What the run trains, read once from `[model]`: a preset with the section's overrides, or an imported Hugging
    Face folder (model.init_from = "hf:PATH"), whose config.json gives the dimensions (checked against its weights
    and tokenizer when it is read), its safetensors the initial weights and its tokenizer.json the data's ids."""

    name: str  # for headers and tables: the preset's, or "hf:PATH (LlamaForCausalLM)"
    model: ModelConfig  # the [model] section
    hf_folder: Path | None = None  # the initial weights and tokenizer; None: a preset, initialised at random
    hf_args: ModelArgs | None = None  # the imported model's dimensions

    @classmethod
    def read(cls, model: ModelConfig) -> ModelSource:
        if not model.init_from:
            return cls(model.preset, model)

        folder = hf.init_folder(model.init_from)
        return cls(f"{model.init_from} ({hf.architecture(folder)})", model, folder, hf.model_args(folder, model))

    def args(self, data_vocab: int | None = None) -> ModelArgs:
        """The model's dimensions: an imported model's, or the preset's with the `[model]` overrides.

        The vocabulary is `model.vocab_size` when set, else the preset's, else the data's (`data_vocab`, the
        tokenizer's size) padded to a multiple of VOCAB_PAD. data_vocab=None (no data prepared): a preset that takes
        its vocabulary from the data then needs `model.vocab_size`, or it is a ConfigError. The sequence length is
        checked against max_seq_len with the batch, by `Layout.validate`."""
        m = self.model
        if self.hf_args is not None:  # architecture and exact vocabulary from its config.json
            args = self.hf_args
        else:
            # every model key but the preset's name and the vocabulary (dimensions, rope, norm, moe_* settings)
            overrides = {k: v for k, v in vars(m).items() if k not in ("preset", "vocab_size", "init_from")}
            vocab = m.vocab_size
            if vocab is None and data_vocab is not None:
                vocab = math.ceil(data_vocab / VOCAB_PAD) * VOCAB_PAD
            if vocab is None and preset_fields(m.preset)["vocab_size"] is None:
                raise ConfigError(f"model preset '{m.preset}' takes its vocab size from the dataset: set "
                                  "model.vocab_size")
            args = preset_args(m.preset, vocab_size=vocab, **overrides)
            if data_vocab is not None and args.vocab_size < data_vocab:
                raise ConfigError(f"model vocab size {args.vocab_size} is smaller than the dataset's {data_vocab}")
        if (m.head_dim is None and self.hf_args is None and args.dim % args.n_heads) or args.n_heads % args.n_kv_heads:
            raise ConfigError(f"model.dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}: "
                              "dim must divide by n_heads (or set model.head_dim) and n_heads by n_kv_heads")
        return args

    def check_export(self, checkpoint, args: ModelArgs) -> None:
        """checkpoint.export_hf: the export at the end must be possible, checked before training."""
        if checkpoint.export_hf:
            check_run(args, self.model.init_from or self.model.preset)


@dataclass(frozen=True)
class DataSource:
    """What the run reads, resolved once from `[data]` and the model: the section (a prepared folder, or a mixture),
    the corpus that folder is prepared from on first use (None: not given) and, for an imported model, its own
    tokenizer.json (the folder is prepared with it, and must hold it)."""

    data: DataConfig  # the [data] section
    corpus: Path | None
    model_tokenizer: Path | None = None
    model_tokenizer_name: str = "data.tokenizer"  # how messages name the tokenizer

    @classmethod
    def read(cls, data: DataConfig, source: ModelSource) -> DataSource:
        corpus = data.source
        if corpus is None and Path(data.dir) == Path(DEFAULT_DATA_DIR):  # the bundled corpus
            corpus = "tinyshakespeare"
        corpus = None if corpus is None else DEFAULT_CORPUS if corpus == "tinyshakespeare" else Path(corpus)
        if source.hf_folder is None:
            return cls(data, corpus)

        # an imported Hugging Face model reads the ids of its own tokenizer
        return cls(data, corpus, hf.dataset_tokenizer(source.hf_folder, data.tokenizer),
                   f"the tokenizer of model.init_from ({source.model.init_from})")


@dataclass(frozen=True)
class RunParts:
    """A run's config read once, before the data is prepared or a process group exists: the parts later code
    receives instead of the config."""

    cfg: Config  # the config itself: its sections configure the trainer, and it is written into the run folder
    world_size: int
    source: ModelSource
    layout: Layout  # as [parallel] gives it; `check` validated it against the model with a placeholder vocabulary
    data: DataSource
    folder: RunFolder


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
    source: ModelSource  # where the model comes from (its name, an imported model's folder)
    lora: LoRA | None = None  # adapters on a frozen model (`[lora]`); None: every weight trains

    @property
    def model_name(self) -> str:
        return self.source.name

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.cfg.training.seq_len

    def recipe(self, device_type: str) -> Recipe:
        """How this run trains (paratrain.recipe.Recipe) on a device of this type."""
        return Recipe.of_run(self.cfg, self.layout, self.global_batch, self.accum_steps, device_type)


def model_args_from(cfg, data_vocab: int | None = None) -> ModelArgs:
    """The model's dimensions from a config (`config.Config`: its `[model]` section, `ModelSource.args`), checked for
    an export at the end (checkpoint.export_hf)."""
    source = ModelSource.read(cfg.model)
    args = source.args(data_vocab)
    source.check_export(cfg.checkpoint, args)
    return args


def batch_of(training, layout: Layout) -> tuple[Batch, str]:
    """The batch the layout must divide (from the `[training]` section), and which of global batch / accumulation
    the user fixed."""
    t = training
    if t.global_batch is not None:
        return Batch(t.global_batch, t.micro_batch, t.seq_len), "global batch fixed; accumulation derived"
    return (Batch(t.micro_batch * t.accum_steps * layout.dp, t.micro_batch, t.seq_len),
            "accumulation fixed; global batch derived")


def check(cfg: Config, world_size: int) -> RunParts:
    """Read the config once into its parts, with every check that needs neither the data nor a process: run before
    preparing data or launching ranks. The vocabulary is a placeholder divisible by tp, so only the vocabulary
    checks wait for the data."""
    layout = Layout.from_config(cfg.parallel, world_size)
    source = ModelSource.read(cfg.model)
    _validated(cfg, source, layout, source.args(VOCAB_PAD * layout.tp), world_size)
    return RunParts(cfg, world_size, source, layout, DataSource.read(cfg.data, source), RunFolder.of(cfg))


def resolve(parts: RunParts, data_meta: dict) -> RunSpec:
    """The whole run, validated against the world size and the prepared data (its meta: vocabulary, and the
    folder holding the tokenizer)."""
    cfg = parts.cfg
    batch, fixed = batch_of(cfg.training, parts.layout)
    args = parts.source.args(data_meta["vocab_size"])
    layout = _validated(cfg, parts.source, parts.layout, args, parts.world_size)
    data_dir = Path(data_meta.get("dir", cfg.data.dir))
    check_packing(cfg.data, data_meta, layout, cfg.training.cuda_graphs)
    return RunSpec(cfg, layout, args, data_dir, batch.global_batch, layout.accumulation(batch), fixed, parts.source,
                   LoRA.from_config(cfg))


def packs_documents(data, meta: dict) -> bool:
    """Whether the run's windows hold whole documents (`data.packing`; "auto": a dataset with loss masks)."""
    return data.packing == "documents" or (data.packing == "auto" and bool(meta.get("loss_mask")))


def check_packing(data, meta: dict, layout: Layout, cuda_graphs: bool = False) -> None:
    if packs_documents(data, meta) and cuda_graphs:
        raise ConfigError("training.cuda_graphs replays one batch shape, and windows of whole documents (data.packing="
                          "documents, the default for a dataset with loss masks) change their attention masks and "
                          "positions every batch: use data.packing=none or training.cuda_graphs=false")
    if packs_documents(data, meta) and layout.cp_enabled:
        raise ConfigError("windows of whole documents (data.packing=documents, the default for a dataset with loss "
                          "masks) are not supported with parallel.cp > 1 yet: ring attention attends across the whole "
                          "window; use tp, pp or data parallelism, or data.packing=none")


def _validated(cfg: Config, source: ModelSource, layout: Layout, args: ModelArgs, world_size: int) -> Layout:
    source.check_export(cfg.checkpoint, args)
    layout.check_checkpointing(cfg.activation_checkpoint.mode)
    # the layouts and checkpointing modes the capabilities run with (the memory tiers: the chunked loss without a
    # pipeline, activation offload's schedules and modes, CPU offload's FSDP)
    for capability in capabilities.active(cfg):
        capability.check_layout(layout)
        capability.check_checkpointing(cfg.activation_checkpoint.mode)
    stage_gpus(cfg.parallel, layout)
    if layout.pipelined and cfg.checkpoint.export_safetensors:
        raise ConfigError("checkpoint.export_safetensors is not supported with parallel.pp > 1 yet "
                          "(the DCP checkpoint loads on any layout)")
    grad_compression_site(layout, cfg.parallel.grad_compression)  # where compression applies, or a ConfigError
    optimizer_entry(cfg.optimizer.name).check_layout(layout)  # the layouts the optimizer refuses
    check_compile(cfg.training, layout)
    return layout.validate(args, world_size, batch_of(cfg.training, layout)[0])


def check_compile(training, layout: Layout) -> None:
    """The layouts torch.compile and CUDA graphs can take."""
    if training.cuda_graphs and layout.pipelined:
        raise ConfigError("training.cuda_graphs with parallel.pp > 1: the pipeline schedule's send/receive between "
                          "stages cannot be captured in a CUDA graph; use training.cuda_graphs=false")


def stage_gpus(parallel, layout: Layout) -> list[str]:
    """`parallel.pp_stage_gpus` (of the `[parallel]` section): the GPU type each pipeline rank runs on (empty: not
    given). ConfigError unless it names one type per pipeline rank."""
    text = parallel.pp_stage_gpus.strip()
    if not text:
        return []
    names = [x.strip() for x in text.split(",")]
    if layout.pp == 1 or len(names) != layout.pp or not all(names):
        raise ConfigError(f"parallel.pp_stage_gpus='{text}' must name one GPU type per pipeline rank "
                          f"(parallel.pp={layout.pp})")
    return names


def provisional(parts: RunParts) -> RunSpec:
    """The run before its data is read: the vocabulary a placeholder no larger than the real one, so what it needs
    is a lower bound of the run's (the memory check before the data is prepared)."""
    cfg = parts.cfg
    batch, fixed = batch_of(cfg.training, parts.layout)
    args = parts.source.args(VOCAB_PAD * parts.layout.tp)
    return RunSpec(cfg, parts.layout, args, Path(cfg.data.dir), batch.global_batch, parts.layout.accumulation(batch),
                   fixed, parts.source, LoRA.from_config(cfg))


def prepare_data(data: DataSource, resume: Path | None = None) -> dict:
    """Use the dataset in data.dir, or prepare it there when the folder is empty (or check a mixture's datasets);
    returns the meta, whose "dir" holds the tokenizer. `resume`: the checkpoint the run continues, whose tokenizer
    an empty data.dir must be prepared with (refused before anything is written)."""
    import sys

    # lazy: torch is not needed for the checks before launch
    from paratrain.data import prepare_for_config

    tokenizer = None if data.model_tokenizer is None else str(data.model_tokenizer)
    if resume is not None and (resume / "meta.json").is_file():
        _check_resume_tokenizer(data, tokenizer, resume)
    meta = prepare_for_config(data.data, data.corpus, tokenizer, data.model_tokenizer_name,
                              echo=lambda text: print(text, file=sys.stderr, flush=True))
    if data.model_tokenizer is not None:
        hf.check_dataset(data.model_tokenizer, data.data.dir)
    return meta


def _check_resume_tokenizer(data: DataSource, tokenizer: str | None, checkpoint: Path) -> None:
    """The tokenizer an empty data.dir would be prepared with is the one `checkpoint` was trained with (by content):
    else the run refuses now, not after writing a dataset it cannot use."""
    # lazy: numpy and the tokenizers library wait until a dataset is read
    from paratrain.data import load_tokenizer, tokenizer_identity, tokenizer_to_prepare

    ours = tokenizer_to_prepare(data.data, data.corpus, tokenizer)
    if ours is None:  # nothing to prepare: the trainer compares the dataset's tokenizer when it resumes
        return
    theirs = load_tokenizer(checkpoint)
    if tokenizer_identity(ours) != tokenizer_identity(theirs):
        raise UserError(f"cannot resume from {checkpoint}: it was trained with another tokenizer ({theirs.kind}, "
                        f"vocab {theirs.vocab_size}) than data.dir={data.data.dir} would be prepared with "
                        f"({ours.kind}, vocab {ours.vocab_size}); nothing was prepared: give the checkpoint's "
                        "tokenizer (data.tokenizer, data.vocab_size), or give this run another run.name")


def resolve_run(cfg: Config, world_size: int) -> RunSpec:
    """Check the config, prepare the data (first use only), and resolve: what a launcher does before starting ranks."""
    parts = check(cfg, world_size)
    return resolve(parts, prepare_data(parts.data))


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

    cfg = load_config(spec)
    for key, value in overrides.items():
        setattr(cfg.model, key, value)
    resolved, data_vocab = cfg, None
    if cfg.model.vocab_size is None and vocab_size is not None:
        resolved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    elif cfg.model.vocab_size is None and (Path(cfg.data.dir) / "meta.json").is_file():
        # a preset that takes its vocabulary from the data (a run's config): the prepared data's, as the trainer's
        from paratrain.data.prepare import read_meta  # lazy: numpy and tokenizers wait until a dataset is read

        data_vocab = read_meta(cfg.data.dir)["vocab_size"]
    try:
        return f"{Path(spec).name} ({cfg.model.preset})", model_args_from(resolved, data_vocab), cfg
    except UserError as e:
        if "takes its vocab size from the dataset" in str(e):
            raise UserError(f"{e} (or --vocab-size N), or prepare data.dir={cfg.data.dir}") from None
        raise
