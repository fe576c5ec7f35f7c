"""Typed configuration: one dataclass per component, loaded from TOML with `--section.key=value` overrides.

Every mistake (unknown key, wrong type, impossible value) is a ConfigError whose one-line message
names the key; nothing is launched or written before the whole config has been validated.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Literal, Union, get_args, get_origin
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from paratrain import allocator, capabilities
from paratrain.capabilities import OPTIMIZER_NAMES, optimizer_entry
from paratrain.capabilities.grad_compression import Compression
from paratrain.errors import ConfigError, did_you_mean
from paratrain.models.args import ModelArgs, is_int
from paratrain.modes import (CheckpointModeName, DPModeOption, OptimizerImpl, PrecisionName, ScheduleName,
                             WeightDtype)

DEFAULT_DATA_DIR = "data/cache/tinyshakespeare-char"  # where the bundled corpus is prepared when no data is given


def _model_config() -> type:
    """`[model]`: the preset's name, an override for every `ModelArgs` field (None keeps the preset's value; derived
    from ModelArgs, so a new dimension is a new key without writing it twice) and `init_from`:
    "hf:PATH" starts from a Hugging Face model folder (config.json + safetensors; architecture, weights and tokenizer
    come from it, the preset and dimension keys are ignored) with a fresh optimizer at step 0.

    Defaults when the preset does not set them: head_dim dim // n_heads, norm_eps 1e-5, rope_scaling "none" (or
    Llama 3.1/3.2's "llama3" with the four rope_* keys), family "llama"; mixture of experts: moe_experts routed
    experts per MoE layer (0: dense; > 0 turns a dense preset into an MoE), moe_top_k experts per token,
    moe_shared_experts every token goes through, moe_ffn_hidden each expert's width (default ffn_hidden),
    moe_first_dense_layers keep the dense MLP and so do the blocks listed in moe_dense_layers (e.g. [1, 3]),
    moe_norm_topk renormalises the top-k gates to sum to 1, moe_aux_loss_coef weights the per-sequence load-balancing loss,
    moe_capacity_factor 0: no limit, else tokens per expert per sequence <= cf x T x k / E."""
    hints = typing.get_type_hints(ModelArgs)
    overrides = [(f.name, hints[f.name] | None, field(default=None)) for f in dataclasses.fields(ModelArgs)]
    cls = dataclasses.make_dataclass("ModelConfig", [("preset", str, field(default="shakespeare-char")), *overrides,
                                                     ("init_from", str, field(default=""))])
    cls.__module__ = __name__  # pickled with the config to spawned ranks
    return cls


ModelConfig = _model_config()


@dataclass
class DataConfig:
    # A dataset already prepared in `dir` is used as it is: source, tokenizer and vocab_size default to its own
    # (meta.json), and one that contradicts it is an error. An empty or missing `dir` is prepared from `source`.
    source: str | None = None  # a path, or "tinyshakespeare" (bundled; the default for the default dir)
    dir: str = DEFAULT_DATA_DIR  # prepared token files
    tokenizer: str | None = None  # byte | char | bpe | path/to/tokenizer.json (preparing: char)
    vocab_size: int | None = None  # for bpe
    val_fraction: float = 0.1  # preparing: the share of documents held out for validation
    mode: Literal["random", "sequential"] = "random"  # random windows | sequential (every window once per epoch, seeded shuffled order)
    # A mixture of prepared datasets sampled by weight (replaces dir/source): [{dir = "data/a", weight = 0.7}, ...]
    sources: list = field(default_factory=list)
    # What a window is: "none" cuts the token stream anywhere (attention across documents); "documents" packs whole
    # documents into each window (attention within a document, positions restarting per document, padding after);
    # "auto": "documents" for a dataset with loss masks (chat / instruction data), else "none".
    packing: Literal["auto", "none", "documents"] = "auto"
    overlong: Literal["truncate", "drop"] = "truncate"  # packing: a document longer than a window is cut, or left out


@dataclass
class TrainingConfig:
    steps: int = 2000  # optimizer steps
    seq_len: int = 64  # tokens per sequence
    micro_batch: int = 12  # sequences per rank per forward
    accum_steps: int = 1  # micro-batches per optimizer step (or set global_batch)
    # If set, the global batch (sequences per optimizer step) is fixed and accum_steps is derived from it.
    global_batch: int | None = None
    seed: int = 1337  # the initial weights and every batch are functions of it, the same on every layout
    # bf16: fp32 master weights, bf16 compute; fp16: dynamic loss scaling too; fp8: bf16 with the blocks' linear layers
    # as 8-bit matmuls (its section: paratrain/capabilities; FP8 tensor cores: compute capability 8.9+, emulated on a CPU)
    precision: PrecisionName = "fp32"
    # fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa; A100: 8x plain fp32's peak); unset: on for
    # fp32 runs on Ampere and newer (compute capability 8.0+), off otherwise. CUDA only
    tf32: bool | None = None
    grad_clip: float = 1.0  # 0 disables
    eval_every: int = 250  # steps between evaluations of the validation loss (0 disables)
    eval_sequences: int = 240  # the validation set: this many fixed sequences of the val split, split over dp ranks
    log_every: int = 10  # steps between log steps (the only steps that read the device)
    compile: bool = False  # torch.compile each block
    # CUDA graphs: replay each compiled block's kernels as one graph (torch.compile's reduce-overhead mode); needs
    # training.compile, a CUDA device, a fixed batch shape (no document packing) and no pipeline
    cuda_graphs: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda where there is one


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # an entry of the optimizer table (paratrain.capabilities.OPTIMIZER_NAMES)
    lr: float = 1e-3  # the peak: linear warm-up to it, then cosine decay to min_lr at the last step
    min_lr: float | None = None  # where the cosine ends; unset: lr / 10
    warmup_steps: int = 100
    weight_decay: float = 0.1  # on matrices only (AdamW: decoupled; sgd: an L2 term)
    beta1: float = 0.9  # Adam's first-moment decay; sgd's momentum
    beta2: float = 0.99  # Adam's second-moment decay
    eps: float = 1e-8
    impl: Literal["auto", OptimizerImpl] = "auto"  # AdamW's implementation; auto: fused (foreach for fp16 on a CPU)

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr


@dataclass
class ParallelConfig:
    dp_mode: DPModeOption = "fsdp"  # data parallelism (zero3 is another name for fsdp)
    dp_replicate: int = 1  # hsdp: replicas of the sharded model (its 2-D mesh is replicate x shard)
    dp_shard: int = -1  # ranks each parameter is sharded over; -1: whatever the other degrees leave of the world
    tp: int = 1  # tensor parallel degree
    sequence_parallel: bool = True  # with tp > 1: shard norms and residuals along the sequence
    loss_parallel: bool = True  # with tp > 1: keep logits sharded by vocab through the loss
    pp: int = 1  # pipeline stages (ranks along the pp mesh axis)
    pp_schedule: ScheduleName = "1f1b"
    pp_microbatches: int = 0  # pipeline micro-batches per optimizer step and data-parallel rank; 0: automatic
    pp_virtual_stages: int = 1  # stages per rank for the interleaved schedules (1: automatic, 2)
    pp_split: str = ""  # blocks per stage, e.g. "3,2,2,1"; empty: balanced by parameter count
    pp_stage_gpus: str = ""  # GPU type of each pipeline rank (heterogeneous clusters, written by paratrain plan)
    ep: int = 1  # expert parallel (MoE): experts sharded over ep of the dp_shard ranks
    cp: int = 1  # context parallel: each sequence split over cp ranks (ring attention; seq_len divisible by 2 x cp)
    ddp_bucket_mb: float = 25.0  # DDP gradient bucket size
    # (here gradient compression's keys, the "communication" group: paratrain/capabilities/grad_compression.py)

    fsdp_forward_prefetch: int = 0  # blocks whose all-gather is issued ahead in forward (0: FSDP2's implicit order)
    fsdp_backward_prefetch: int = 1  # blocks prefetched ahead in backward (1: FSDP2's default, the previous block)


@dataclass
class ActivationCheckpointConfig:
    """Activation checkpointing (recompute in backward instead of storing)."""

    # what backward recomputes instead of keeping (docs/memory-tiers.md compares the modes)
    mode: CheckpointModeName = "none"
    # mode every_k: blocks 0, k, 2k, ... recompute (full), the blocks between keep everything (segments stores every k)
    every_k: int = 2


@dataclass
class MemoryConfig:
    """Training what does not fit on the device (docs/memory-tiers.md; each tier's keys and rules: its capability,
    paratrain/capabilities)."""

    # the CUDA caching allocator's settings (torch's key:value,... syntax), set in every rank's environment before CUDA
    # starts: expandable segments grow in place instead of leaving gaps between cached blocks (torchtitan's default);
    # "": torch's own default. Your own PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF wins (docs/troubleshooting.md)
    allocator: str = "expandable_segments:True"


@dataclass
class CheckpointConfig:
    """Training-state checkpoints."""

    every: int = 0  # steps between saves; 0 saves only at the end
    # minutes of wall time between saves, besides `every` (0: off): a long run interrupted any way loses at most this
    every_minutes: float = 10.0
    keep: int = 2  # the newest checkpoints kept (at least 2)
    resume: str = "none"  # none | auto | path to a step-N folder
    save_final: bool = True  # save a checkpoint at the last step
    # staged to host memory (pinned on a GPU), written by a writer process, hashed and committed in the background;
    # one save in flight (false: training waits for each save)
    async_save: bool = True
    export_safetensors: bool = False  # also write consolidated weights to RUN_DIR/model.safetensors at the end
    export_hf: bool = False  # at the end, also export the final checkpoint as a Hugging Face folder RUN_DIR/hf
    export_hf_dtype: WeightDtype = "bf16"  # the dtype of the exported weights


@dataclass
class ResilienceConfig:
    """Surviving crashes, preemption, bad steps, out-of-memory and hangs."""

    max_restarts: int = 0  # relaunch all ranks from the last checkpoint when one dies (`--max-restarts`)
    collective_timeout_s: float = 600.0  # a collective that takes longer ends the run with an error
    preempt_grace_s: float = 30.0  # after SIGTERM: save and exit within this many seconds
    max_bad_steps: int = 3  # consecutive non-finite steps before rolling back to the last checkpoint
    memory_budget_gib: float = 0.0  # > 0: activation bytes per micro-step above this count as out-of-memory
    # before building the model, refuse a run the memory estimate says does not fit this machine's device memory (host
    # RAM on a CPU, shared by the node's ranks); false (`paratrain train --force`): try anyway
    memory_check: bool = True


@dataclass
class MetricsConfig:
    peak_tflops: float = 0.0  # device peak for MFU; 0 looks the device up (no datasheet entry, e.g. a CPU: no MFU)
    progress: Literal["auto", "bar", "lines", "none"] = "auto"  # auto: one live line on a terminal, else lines
    # at start-up also the memory estimate's table (always in run_dir/memory-estimate.txt) and each rank's place in the
    # mesh (`paratrain train --verbose`)
    verbose: bool = False
    # Prometheus endpoint (needs prometheus_client): 0 = off. One endpoint per node (local rank 0, every rank's
    # memory labelled rank="N"), or with prometheus_per_rank one per rank on port + local_rank.
    prometheus_port: int = 0
    prometheus_host: str = "127.0.0.1"  # 0.0.0.0 to let a Prometheus server on another host scrape it
    prometheus_per_rank: bool = False
    prometheus_linger_s: float = 0.0  # at the end, keep serving until one scrape has read the final values (max s)
    tensorboard: bool = False  # scalars under run_dir/tensorboard (needs tensorboard)
    # torch.profiler over steps [profile_start, profile_start + profile_steps) of the run (0: off); traces and the
    # compute / exposed-communication split in run_dir/profile (what `paratrain profile` sets)
    profile_steps: int = 0
    profile_start: int = 1  # step 0 warms up (lazy initialisation, DDP's bucket rebuild)
    # every N steps: per-block max |x| and RMS of activations, attention logits, MLP hidden, gradients and weights,
    # and the bf16/fp16 headroom (0: off; a non-finite step is always replayed to name its first non-finite module)
    numerics_every: int = 0


@dataclass
class SampleConfig:
    """Text generated at the end of training."""

    prompt: str = "\n"
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0 is greedy
    top_k: int = 50  # 0 disables


@dataclass
class EvalConfig:
    """Downstream tasks (lm-evaluation-harness) during training and at its end; docs/evaluation.md."""

    tasks: list = field(default_factory=list)  # lm-eval task or group names, e.g. ["shakespeare"] (bundled)
    include_path: str = ""  # a folder of task YAML files of your own (its !function entries are code)
    every: int = 0  # also every N steps (0: only at the end)
    limit: int = 0  # documents per task (0: all)
    num_fewshot: int = -1  # few-shot examples per request (-1: each task's own)
    batch_size: int = 8  # requests per forward


@dataclass
class RunConfig:
    name: str = "default"  # the run folder: out_dir/name (one folder name, at most 100 characters)
    out_dir: str = "runs"
    # A new run (checkpoint.resume = "none") into a run folder that holds files is an error; true deletes that
    # folder first (after every check has passed) and starts over.
    overwrite: bool = False


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _extended(cls: type, added: list[tuple], after: dict[str, list[tuple]] | None = None) -> type:
    """`cls` with more fields, under the same name and module (pickled with the config to spawned ranks): `added` at
    the end, `after` {key of cls: fields placed right after it}."""
    if not added and not after:
        return cls
    if after:  # a new class with every field in place (a subclass would list its fields after the base's)
        hints = typing.get_type_hints(cls)
        fields = [(f.name, hints[f.name], _same_default(f)) for f in dataclasses.fields(cls)]
        fields = [placed for one in fields for placed in [one, *after.get(one[0], [])]]
        methods = {k: v for k, v in vars(cls).items() if not k.startswith("__")}
        extended = dataclasses.make_dataclass(cls.__name__, fields + added, namespace=methods)
    else:
        extended = dataclasses.make_dataclass(cls.__name__, added, bases=(cls,))
    extended.__module__, extended.__qualname__, extended.__doc__ = __name__, cls.__qualname__, cls.__doc__
    return extended


def _same_default(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


def _with_capabilities(config: type) -> type:
    """Config with the capabilities' settings (paratrain/capabilities): the keys they add to a built-in section
    (a `[training]` key, ...) and the sections they own (fp8's, ...), each declared once, in its capability."""
    owned = capabilities.own_sections()
    sections = [(name, section, field(default_factory=section)) for name, (section, after) in owned.items()
                if after is None]  # (at the end)
    for f in reversed(dataclasses.fields(config)):
        sections[:0] = [(name, section, field(default_factory=section)) for name, (section, after) in owned.items()
                        if after == f.name]
        added, after = [], {}
        for keys, key in capabilities.added_keys_after(f.name):
            fields = [(k.name, typing.get_type_hints(keys)[k.name], field(default=k.default))
                      for k in dataclasses.fields(keys)]
            (added if key is None else after.setdefault(key, [])).extend(fields)
        section = _extended(f.default_factory, added, after)
        globals()[section.__name__] = section  # `from paratrain.config import TrainingConfig` gets the whole section
        sections.insert(0, (f.name, section, field(default_factory=section)))
    # a new class (not a subclass: a subclass would list the sections it adds after the built-in ones)
    methods = {k: v for k, v in vars(config).items() if not k.startswith("__")}
    extended = dataclasses.make_dataclass(config.__name__, sections, namespace=methods)
    extended.__module__, extended.__qualname__, extended.__doc__ = __name__, config.__qualname__, config.__doc__
    return extended


Config = _with_capabilities(Config)


# Sections that were renamed: the old name is an error that names the new one.
RENAMED_SECTIONS = {"checkpointing": "activation_checkpoint"}
# Keys that were replaced: the old key is an error that names the new one (and what changed).
REPLACED_KEYS = {"training.eval_batches": ("training.eval_sequences", "a number of sequences, the same on every layout, "
                                           "not of global batches: N batches of B sequences -> N x B")}


def _suggest(name: str, options) -> str:
    return did_you_mean(name, options, cutoff=0.6)


def _coerce(key: str, value, annotation):
    """Check (TOML values) or parse (command-line strings) one value against its type annotation."""
    options = annotation_members(annotation)
    allowed = tuple(o for o in options if isinstance(o, type))
    choices = tuple(o for o in options if not isinstance(o, type))  # Literal values
    if list in allowed:  # a TOML array, or on the command line the same written inline
        if isinstance(value, str) and not value.lstrip().startswith("["):  # names: --eval.tasks=a,b
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, str):
            tomllib = toml_reader()
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{key}: expected a TOML array like [{{dir = \"data/a\", weight = 0.7}}] ({e})") from None
        if isinstance(value, list):
            return value
    unset = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
    if tuple in allowed and not unset:  # integers (model.moe_dense_layers): a TOML array, inline on a command line
        wanted = f"{key}: expected a list of integers like [1, 3], got {value!r}"
        if isinstance(value, str):
            tomllib = toml_reader()
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                raise ConfigError(wanted) from None
        if not isinstance(value, (list, tuple)) or not all(is_int(v) for v in value):
            raise ConfigError(wanted)
        return tuple(value)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in allowed):
        if type(None) in allowed:
            return None
        raise ConfigError(f"{key}: a value is required")
    if choices:
        if value in choices:
            return value
        shown = ", ".join(map(str, choices))
        raise ConfigError(f"{key}: '{value}' is not one of {shown}{_suggest(str(value), [str(c) for c in choices])}")
    if isinstance(value, str) and str not in allowed:
        for t in (bool, int, float):
            if t in allowed:
                return _coerce(key, _parse_scalar(key, value, t), annotation)
    if bool in allowed and isinstance(value, bool):
        return value
    if int in allowed and isinstance(value, int) and not isinstance(value, bool):
        return value
    if float in allowed and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if str in allowed and isinstance(value, str):
        return value
    wanted = " or ".join(t.__name__ for t in allowed if t is not type(None))
    raise ConfigError(f"{key}: expected {wanted}, got {type(value).__name__} {value!r}")


def annotation_members(annotation) -> tuple:
    """The plain types and Literal values an annotation admits: `Literal['a', 'b'] | None` -> ('a', 'b', NoneType)."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(m for arg in get_args(annotation) for m in annotation_members(arg))
    if get_origin(annotation) is tuple:  # tuple[int, ...]
        return (tuple,)
    return (annotation,)


def parse_bool(key: str, text: str) -> bool:
    """A boolean as a command line writes it (true/false, 1/0, yes/no, on/off); ConfigError naming `key` else."""
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {text!r}")


def _parse_scalar(key: str, text: str, t: type):
    if t is bool:
        return parse_bool(key, text)
    try:
        return t(text)
    except ValueError:
        raise ConfigError(f"{key}: expected {t.__name__}, got {text!r}") from None


def _set(cfg: Config, dotted: str, value) -> None:
    if dotted.count(".") != 1:
        raise ConfigError(f"config key '{dotted}' must be section.key (e.g. training.steps)")
    section_name, key = dotted.split(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name in RENAMED_SECTIONS:
        raise ConfigError(f"config section '{section_name}' is now called '{RENAMED_SECTIONS[section_name]}' "
                          f"({section_name}.{key} -> {RENAMED_SECTIONS[section_name]}.{key})")
    if dotted in REPLACED_KEYS:
        new_key, why = REPLACED_KEYS[dotted]
        raise ConfigError(f"config key '{dotted}' is now '{new_key}' ({why})")
    if section_name not in sections:
        raise ConfigError(f"unknown config section '{section_name}'{_suggest(section_name, sections)}")
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        full = [f"{section_name}.{k}" for k in fields]
        all_keys = [f"{s}.{f.name}" for s in sections for f in dataclasses.fields(getattr(cfg, s))]
        raise ConfigError(f"unknown config key '{dotted}'{_suggest(dotted, full) or _suggest(dotted, all_keys)}")
    setattr(section, key, _coerce(dotted, value, typing.get_type_hints(type(section))[key]))


def toml_reader():
    """The TOML reader, imported when first needed (compiling its patterns is ~5 ms of every command's start-up)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib


def read_toml(p: Path) -> dict:
    """A TOML file's tables; ConfigError (one line) when it is not TOML."""
    tomllib = toml_reader()
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- TOML file <- `section.key=value` overrides, then validate."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        data = read_toml(p)
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{p}: top-level key '{section}' must be a [section] table")
            for key, value in table.items():
                _set(cfg, f"{section}.{key}", value)
    for item in overrides:
        item = item.removeprefix("--")
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like --section.key=value")
        key, value = item.split("=", 1)
        _set(cfg, key, value)
    validate(cfg)
    return cfg


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    """Checks that need no data or world size. The parallel layout is checked by `paratrain.layout.Layout`."""
    for section in dataclasses.fields(cfg):  # values set in code (not through _set) still get their choices checked
        table = getattr(cfg, section.name)
        for key, annotation in typing.get_type_hints(type(table)).items():
            if get_origin(annotation) is Literal:
                _coerce(f"{section.name}.{key}", getattr(table, key), annotation)
    _check_numbers_and_paths(cfg)
    check_run_name(cfg.run.name)
    _check_training_and_optimizer(cfg)
    _check_runtime(cfg)
    _check_features_and_outputs(cfg)


def _check_training_and_optimizer(cfg: Config) -> None:
    """The batch and the step counts, and the optimizer's common settings (an optimizer's own: its capability)."""
    t, o = cfg.training, cfg.optimizer
    for dotted in ("training.steps", "training.seq_len", "training.micro_batch", "training.accum_steps",
                   "training.eval_sequences", "training.log_every"):
        section, key = dotted.split(".")
        _require(getattr(getattr(cfg, section), key) > 0, f"{dotted} must be positive")
    _require(t.global_batch is None or t.global_batch > 0, "training.global_batch must be positive")
    _require(t.eval_every >= 0, "training.eval_every must be >= 0 (0 disables)")
    _require(t.grad_clip >= 0, "training.grad_clip must be >= 0 (0 disables)")
    entry = optimizer_entry(o.name)  # a registered optimizer, or a ConfigError naming them
    Compression.from_config(cfg.parallel).check_optimizer(entry)
    _require(o.lr > 0, f"optimizer.lr must be positive, got {o.lr}")
    _require(o.min_lr is None or 0 <= o.min_lr <= o.lr,
             f"optimizer.min_lr must be between 0 and optimizer.lr ({o.lr}), got {o.min_lr}")
    _require(o.warmup_steps >= 0, "optimizer.warmup_steps must be >= 0")
    _require(o.weight_decay >= 0, "optimizer.weight_decay must be >= 0")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optimizer.beta1 and optimizer.beta2 must be in [0, 1)")
    _require(o.eps > 0, "optimizer.eps must be positive")


def _check_runtime(cfg: Config) -> None:
    """Checkpointing, memory tiers, checkpoints, resilience, communication, metrics and data."""
    _require(cfg.activation_checkpoint.every_k >= 1, "activation_checkpoint.every_k must be >= 1")
    allocator.check(cfg.memory.allocator)
    _require(cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0 saves only at the end)")
    _require(cfg.checkpoint.every_minutes >= 0, "checkpoint.every_minutes must be >= 0 (0: off)")
    _require(cfg.checkpoint.keep >= 2, "checkpoint.keep must be >= 2 so a bad save never leaves no checkpoint")
    _require(not cfg.checkpoint.export_hf or cfg.checkpoint.save_final,
             "checkpoint.export_hf exports the final checkpoint: it needs checkpoint.save_final=true")
    _require(not cfg.model.init_from or cfg.model.init_from.startswith("hf:"),
             f"model.init_from must be hf:PATH (a Hugging Face model folder), got '{cfg.model.init_from}'")
    r = cfg.resilience
    _require(r.max_restarts >= 0, "resilience.max_restarts must be >= 0")
    _require(r.collective_timeout_s > 0, "resilience.collective_timeout_s must be positive")
    _require(r.preempt_grace_s > 0, "resilience.preempt_grace_s must be positive")
    _require(r.max_bad_steps >= 1, "resilience.max_bad_steps must be >= 1")
    _require(r.memory_budget_gib >= 0, "resilience.memory_budget_gib must be >= 0 (0 disables)")
    p = cfg.parallel  # the degrees are checked against the world size by paratrain.layout.Layout
    _require(p.ddp_bucket_mb > 0, "parallel.ddp_bucket_mb must be positive")
    _require(p.fsdp_forward_prefetch >= 0 and p.fsdp_backward_prefetch >= 1,
             "parallel.fsdp_forward_prefetch must be >= 0 and parallel.fsdp_backward_prefetch >= 1")
    _require(cfg.metrics.profile_steps >= 0 and cfg.metrics.profile_start >= 0,
             "metrics.profile_steps and metrics.profile_start must be >= 0")
    _require(cfg.metrics.numerics_every >= 0, "metrics.numerics_every must be >= 0 (0: off)")
    _require(0 < cfg.data.val_fraction <= 0.5, "data.val_fraction must be in (0, 0.5]")
    if cfg.data.sources:
        from paratrain.data.mixture import parse_sources  # lazy: numpy is not needed for --help and most configs

        parse_sources(cfg.data.sources)  # dirs, weights >= 0, not all zero, distinct names


def _check_features_and_outputs(cfg: Config) -> None:
    """The capabilities' own checks (paratrain/capabilities), CUDA graphs, the sample and downstream evaluation."""
    t, r = cfg.training, cfg.resilience
    capabilities.check(cfg)
    _require(not t.cuda_graphs or t.compile, "training.cuda_graphs captures the compiled blocks: it needs "
             "training.compile=true")
    _require(not t.cuda_graphs or t.device != "cpu", "training.cuda_graphs needs a CUDA device (training.device=cpu)")
    s = cfg.sample
    _require(s.max_new_tokens >= 0, "sample.max_new_tokens must be >= 0")
    _require(s.temperature >= 0, "sample.temperature must be >= 0 (0 is greedy)")
    _require(s.top_k >= 0, "sample.top_k must be >= 0 (0 disables)")
    e = cfg.eval
    _require(e.every >= 0, "eval.every must be >= 0 (0: only at the end)")
    _require(e.limit >= 0, "eval.limit must be >= 0 (0: every document)")
    _require(e.num_fewshot >= -1, "eval.num_fewshot must be >= -1 (-1: each task's own)")
    _require(e.batch_size >= 1, "eval.batch_size must be at least 1")
    _require(all(isinstance(t, str) and t for t in e.tasks), "eval.tasks must be a list of task names")
    _require(not e.every or e.tasks, "eval.every needs eval.tasks (the lm-eval tasks to run)")
    _require(r.collective_timeout_s <= MAX_TIMEOUT_S, f"resilience.collective_timeout_s must be at most "
             f"{MAX_TIMEOUT_S} s (a week), got {r.collective_timeout_s:g}")


# -- checks of every value of a kind (reliability) ------------------------------------------------------------------
MAX_RUN_NAME = 100  # characters of run.name: one folder name, well inside NAME_MAX (255 bytes) in UTF-8
MAX_TIMEOUT_S = 7 * 86400


def check_run_name(name: str) -> None:
    """run.name is one folder under run.out_dir: never a path, never '.' or '..' (which would write the run's files
    into run.out_dir itself or above it)."""
    import os

    _require(bool(name) and name.strip() == name, f"run.name must be a folder name without leading or trailing "
             f"spaces, got {name!r}")
    _require(name not in (".", "..") and "/" not in name and os.sep not in name and "\\" not in name,
             f"run.name must be a single folder name (no '/', not '.' or '..'), got {name!r}")
    _require(len(name) <= MAX_RUN_NAME and len(name.encode("utf-8", "surrogateescape")) <= 255,
             f"run.name is {len(name)} characters long; at most {MAX_RUN_NAME}")
    _require(name.isprintable(), f"run.name must not contain control characters, got {name!r}")


def _check_numbers_and_paths(cfg: Config) -> None:
    """No NaN or infinity in any number (an `inf` learning rate trains NaN weights and saves them), no NUL byte in a
    path."""
    import math

    for section in dataclasses.fields(cfg):
        table = getattr(cfg, section.name)
        for f in dataclasses.fields(table):
            value, key = getattr(table, f.name), f"{section.name}.{f.name}"
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, got {value}")
            if isinstance(value, str) and "\0" in value:
                raise ConfigError(f"{key} must not contain a NUL byte")


def config_keys_help() -> str:
    """Every config key with its default and, for a choice, the allowed values (for `paratrain train --help`)."""
    lines = []
    for section in dataclasses.fields(Config):
        table = getattr(Config(), section.name)
        hints = typing.get_type_hints(type(table))
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(table):
            default = getattr(table, f.name)
            choices = [str(c) for c in annotation_members(hints[f.name]) if not isinstance(c, type)]
            if (section.name, f.name) == ("optimizer", "name"):  # a registry, not a Literal
                choices = list(OPTIMIZER_NAMES)
            shown = ("unset" if default is None else repr(default) if isinstance(default, str)
                     else str(default).lower() if isinstance(default, bool) else str(default))
            lines.append(f"  --{section.name}.{f.name}={shown}" + (f"   ({' | '.join(choices)})" if choices else ""))
    return "\n".join(lines)


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML, saved beside each run so it can be replayed exactly (None values are left out:
    TOML has no null, and a missing key loads as its default, None)."""
    return tomli_w.dumps({section: {key: value for key, value in table.items() if value is not None}
                          for section, table in cfg.to_dict().items()})
