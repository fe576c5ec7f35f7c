"""What a capability is: one class that declares its settings, its checks, its hooks into the training step, its
memory and time terms and its verify rows, so that the trainer, the estimator, the planner and verify iterate over
the registered capabilities (paratrain/capabilities/__init__.py) and never name one.

A capability is a frozen dataclass whose fields are its resolved settings for one run; `from_config` reads them from a
run's config and returns None when the run does not use it. The class says where its keys live: a config section of
its own (`section`: a dataclass whose fields are the `[name]` keys), and keys it adds to an existing section
(`adds_to`: (section name, a dataclass of those keys), e.g. z-loss's key in `[training]`). docs/configuration.md, the config's
checks and the command-line `--section.key=value` overrides follow from those dataclasses.

The hooks are called at fixed points of a step (paratrain/training/step.py), always in the registry's order:

    compute_precision   the precision everything else computes in (fp8: bf16 around its 8-bit matmuls)
    check_device        before the model is built: a one-line UserError for a device that cannot run it
    before_parallelize  the plain model (or pipeline stage) on the meta device, before tensor parallelism; returns
                        tensor-parallel styles for the modules it changed ({module name: (colwise, rowwise)})
    around_tensor_parallel  a context manager tensor parallelism lays the model out inside (low-rank adapters:
                        held aside, then split with the weights they adapt)
    loss_term           an extra loss on the logits (with the cross-entropy's reduction), logged under its `name`
    after_build         once the step is built, before a checkpoint is loaded (a local-SGD round's state)
    after_optimizer_step  after each optimizer update (fp8's precomputed scales)
    after_expert_loads  then, on a mixture-of-experts model, with the step's expert loads over every micro-batch and
                        data-parallel rank (a routing bias moved toward even loads)
    gradient_reduction  what the data-parallel gradient reduction runs (a classmethod: gradient compression's
                        `GradReduction`, which the run's GradComm takes; distributed/ never imports the registry)
    checkpoint_state    the state a checkpoint saves and loads into, as plain tensors (a classmethod: every registered
                        capability's runs on every run's state, as a wrapper can outlive the run that made it)

and the estimator and the planner ask (torch-free): `weight_copies` (the low-precision weight copies a step keeps),
`linear_gemm_rate` and `elementwise_values` (a block's compute time), `optimizer_temporaries` (what an optimizer it
brings allocates in its step beside the states), `optimizer_step_s` (that step's own seconds and the communication
it exposes), `replica_states` (copies a rank keeps beside its states) and `plan_alternative` (another way to train the
request that `paratrain plan` weighs beside its plain plan: local SGD across slow links).

A memory tier can be a capability that a layout's name switches on (`layout_item`; CPU offload, activation offload):

    layout_value, from_layout_value   its item's value in a name, and the capability a name's value turns on
    tier_state          what the JSON documents say under its name (on or not; activation offload: its mode)
    runs_on, check_layout, check_checkpointing   the layouts and checkpointing modes it can run with
    plan_problem        why the planner cannot predict it with these settings (`plan --explain`), or None
    fsdp_offload_policy, states_on_host   FSDP's offload policy; the model states (and the optimizer) on the host
    host_activations    the blocks whose saved activations it keeps in host memory (parallelize applies
                        distributed/offload.py's hooks to them; the estimator takes their bytes off the device)
    host_states, host_optimizer_s, fsdp_copy_s, host_activation_s   its memory and time terms

and one a Recipe gives by name (`recipe_setting`: the chunked loss's pieces), always resolved, with its automatic
value decided once the model and the micro-batch are known:

    tier_state, from_setting   the setting's value (read as a Recipe attribute), and the capability a value is (None:
                        off)
    loss_pieces         the pieces the output projection and the loss run over for a micro-batch (the trainer,
                        per micro-batch; the estimator's memory of the logits)
    resolved            the capability with its automatic settings decided (the estimator's recipe)
    head_recompute_s    its time term: what backward recomputes of the output head

A checkpointing mode can be a capability (`checkpoint_mode`; runs of blocks recomputed as one): `from_recipe` its value,
`checkpoint_units` the blocks that recompute together (the estimator's walk, parallelize's checkpoints),
`checkpointing_label` / `parse_checkpointing_label` its `ac=` value in a layout's name, `describe_checkpointing`.

`where` (a `Where`) says on which device and layout a hook runs.

This module is torch-free: a capability imports torch inside its hooks (`# lazy:`), so `--help`, the config checks,
the estimator and the planner never load it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

from paratrain.errors import UserError


MOE_PRESET = "model.preset=tiny-moe"  # verify rows: with the base's 4 layers, 1 dense + 3 MoE layers


@dataclass(frozen=True)
class RowTerms:
    """A verify row's own terms, written last in its tuple where they differ from the sweep's: the steps it runs
    (`paratrain verify --steps` overrides them) and its (loss, weight, val loss) tolerances, each the larger of its own
    and the sweep's (a tolerance is only meaningful for the steps it was measured over: fp8's)."""

    steps: int | None = None
    tolerance: tuple[float, float, float] | None = None


def host_link(hw):
    """The device <-> host link of a profile (estimate.profile.Hardware) the offloading tiers copy over."""
    if hw.host is None:
        raise ValueError(f"profile {hw.name} has no host side: the offloading tiers cannot be predicted on it")
    return hw.host


@dataclass(frozen=True)
class Where:
    device: object  # torch.device
    layout: object  # paratrain.layout.Layout
    precision: str | None = None  # what the model computes in (parallelize's hooks; a paratrain.modes.Precision)
    # the step's hooks (after_build, after_optimizer_step): the run's GradComm (its meshes, step, per-rank checkpoint
    # state) and optimizer
    comm: object = None
    optimizer: object = None


@dataclass(frozen=True)
class WeightCopies:
    """A capability's term of the estimator's low-precision weight copies (paratrain/estimate/model_states.py): the
    parameters whose copy autocast does not cache (the capability casts them itself), and the bytes of its own copies
    at their peak, with the line the estimate's notes print."""

    uncached: frozenset[str] = frozenset()
    bytes: int = 0
    note: str = ""


@dataclass(frozen=True)
class SectionFlag:
    """A command-line flag of one key of a capability's own section, taken by the commands it has help for
    (`helps`: {"estimate" | "plan": its help there}): given, it sets the key over the config's (or the defaults'),
    and a bad value is the section's problem (`section_problem`) named by the flag."""

    flag: str
    key: str
    helps: dict
    type: type = str


@dataclass(frozen=True)
class PlanRow:
    """A ranked row a capability adds to `paratrain plan`'s table (`Capability.plan_alternative`): a search Result on
    the plan's world (its candidate's recipe carries the capability, so the written config trains it), what the
    table's note column says of it, and the keys its JSON entry adds."""

    result: object  # paratrain.estimate.search.Result
    note: str
    json: dict


@dataclass(frozen=True)
class PlanFlag:
    """`paratrain plan`'s switch of a capability, a shorthand for another setting (the request's `setting` given
    `value`: fp8's flag is `--precision fp8`); the plan's JSON says under the flag's name whether the plan uses the
    capability."""

    flag: str
    help: str
    setting: str  # a field of estimate.planner.PlanRequest
    value: object

    @property
    def key(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Capability:
    name: ClassVar[str] = ""  # what metrics and messages call it
    section: ClassVar[type | None] = None  # the dataclass of its own config section, `[name]`
    section_after: ClassVar[str | None] = None  # the built-in section it follows in a config file (None: at the end)
    adds_to: ClassVar[tuple[str, type] | None] = None  # (section, dataclass of the keys it adds there)
    # the key of that section its keys follow (None: after the section's own and earlier capabilities'): where they
    # were before they moved to the capability, so configs, --help and docs/configuration.md list them in place
    adds_after: ClassVar[str | None] = None
    # verify rows: row name -> (ranks, layout name, overrides..., RowTerms where its steps or tolerances are its own),
    # as paratrain/verify.py's LAYOUTS
    verify_rows: ClassVar[dict[str, tuple]] = {}
    # verify rows that resume on another layout: row name (`resume-FIRST:SECOND`) -> (one of its `verify_rows`, trained
    # with a checkpoint at half the steps, (ranks, layout name) the rest resumes on): its state moves between layouts
    # exactly (paratrain/verify.py's Resumed)
    resumed_rows: ClassVar[dict[str, tuple[str, tuple[int, str]]]] = {}
    # the overrides of a row that its single-process reference keeps (the settings that change what is computed)
    reference_keys: ClassVar[tuple[str, ...]] = ()
    reference_micro_batch: ClassVar[int | None] = None  # a row's reference runs forwards of this many sequences
    # the optimizer-table entries it brings (paratrain.optimizers.OptimizerEntry; their builders: training/optim.py's
    # BUILDERS): `optimizer.name` selects them as a built-in one (paratrain.capabilities.OPTIMIZERS)
    optimizers: ClassVar[tuple] = ()
    # the data-parallel replicas (dp_replicate) keep their own gradients: the per-step reduction across them is not
    # run (GradComm), the capability synchronises them itself (a local-SGD outer step)
    local_replicas: ClassVar[bool] = False
    # it runs torch's PowerSGD hook, which waits on a collective inside a gloo worker's callback: the run's gloo groups
    # keep two workers (distributed/gloo_workers.py)
    waits_in_collective_callbacks: ClassVar[bool] = False

    @classmethod
    def from_config(cls, cfg) -> "Capability | None":
        """This run's settings (a paratrain.config.Config), or None when the run does not use the capability."""
        return None

    @classmethod
    def implied_by(cls, recipe) -> bool | None:
        """Whether a recipe's other settings turn it on (its precision, its optimizer), for a capability that
        such a setting decides: a Recipe holds it exactly when implied (`Recipe.__post_init__`: added with its defaults,
        or dropped), so the estimator and the planner see it on every recipe. None: no setting decides it (its own
        keys do: z-loss)."""
        return None

    # the Recipe field that holds it, for a capability a recipe carries as a setting of its own (the low-rank
    # adapters'): a Recipe holds it among its capabilities exactly when that field does (`capabilities.implied`),
    # however the recipe was made or replaced
    recipe_field: ClassVar[str | None] = None
    # the activation checkpointing mode it is (`activation_checkpoint.mode`, a paratrain.modes.CheckpointMode value): a
    # Recipe holds it exactly when its mode is this one (`from_recipe`: with the recipe's settings), however the
    # recipe was made or replaced
    checkpoint_mode: ClassVar[str | None] = None

    @classmethod
    def from_recipe(cls, recipe) -> "Capability":
        """Its value in a recipe whose checkpointing mode is `checkpoint_mode` (with the recipe's settings of it)."""
        return cls()

    @classmethod
    def check(cls, cfg) -> None:
        """Checks of its settings that need no world size or data: a one-line ConfigError."""

    @classmethod
    def section_problem(cls, section) -> str | None:
        """What is wrong with its own section's values, naming the key as "section.key", or None: what its
        `section_flags` are checked by."""
        return None

    @classmethod
    def uses(cls, overrides: list[str]) -> bool:
        """A verify row's overrides turn it on (their reference gets its keys)."""
        return False

    # -- the training step (torch objects; imports inside) --
    def compute_precision(self, precision: str) -> str:
        return precision

    def check_device(self, device) -> None:
        pass

    def before_parallelize(self, model, where: Where) -> dict:
        return {}

    def around_tensor_parallel(self, model, tp_mesh):
        """A context manager that `model`'s tensor-parallel plan is applied inside (over `tp_mesh`)."""
        return contextlib.nullcontext()

    def loss_term(self, logits, targets, reduction: str):
        return None

    def after_build(self, model, where: Where) -> None:
        """Once the step is built: the weights initialised, before a checkpoint is loaded (a local-SGD round's state)."""

    def after_optimizer_step(self, model, where: Where) -> None:
        pass

    def after_expert_loads(self, model, loads, finite) -> None:
        """After each optimizer step (and `after_optimizer_step`) of a model with MoE layers: `loads` (MoE layers of
        `model`, E) fp64, the step's top-k assignments per expert over every micro-batch and data-parallel rank (the
        same on every rank; a pipeline stage's own layers); `finite`: the step's flag (True, or a device bool that
        is False where the update was skipped)."""

    @classmethod
    def gradient_reduction(cls, compression, layout, entry, optimizer=None, steps: int = 0):
        """The gradient-communication point (training/step.py, before the model is laid out): what the run's
        data-parallel gradient reduction runs on `layout` (a value distributed/compression.py's GradComm takes: the
        collective, where it acts, an optimizer's schedule), from the recipe's `compression`, the optimizer's
        table entry, its OptimizerConfig and the run's optimizer steps; None where the capability does not decide it
        (a classmethod: the registry's first answer counts; gradient compression's is every run's)."""
        return None

    @classmethod
    def checkpoint_state(cls, state):
        """`state` (a nested state dict) with the tensor subclasses the capability wraps parameters or optimizer
        states in replaced by the plain tensors inside: DCP would pickle the subclass, which a weights-only load
        refuses."""
        return state

    # -- the estimator and the planner (torch-free) --
    plan_label: ClassVar[str] = ""  # what `paratrain plan`'s header says of it ("" : nothing)
    section_flags: ClassVar[tuple[SectionFlag, ...]] = ()  # `paratrain estimate`'s and `plan`'s flags of its keys
    plan_flag: ClassVar[PlanFlag | None] = None  # `paratrain plan`'s switch for it (and its key in the JSON)
    # the matmul rate (paratrain.modes.MatmulMath) of GEMMs it runs on their own tensor cores, which calibration
    # times (`time_gemm`) for the profile's curve of that rate (estimate.profile.Hardware: "fp8" -> fp8_gemm)
    gemm_math: ClassVar[str | None] = None

    @classmethod
    def time_gemm(cls, a, b, timed) -> float | None:
        """Seconds of its GEMM of the 16-bit `a @ b` on their device (`timed(fn)` times a call), None where the device
        or the shapes cannot run it."""
        return None

    def check_hardware(self, hardware: list) -> None:
        """The planner's GPUs (estimate.profile.Hardware, each group's): a one-line UserError where it cannot run."""

    def linear_gemm_rate(self, hw, flop: float) -> float | None:
        """The FLOP/s of one of the blocks' linear GEMMs of `flop` on `hw` (an estimate.profile.Hardware) where the
        capability changes it (fp8: the profile's 8-bit rate), else None; the head and attention keep theirs."""
        return None

    def elementwise_values(self, hw, dim: float, ffn_width: float) -> float:
        """Values per token a block's forward and backward read and write on `hw` besides the model's own element-wise
        ops (`dim`: the model width, `ffn_width`: the MLP's hidden width on a tensor-parallel rank)."""
        return 0.0

    def weight_copies(self, args, params) -> WeightCopies | None:
        """Its weight copies on a rank holding `params` ((Param, count, local elements) of the model's parameter table:
        paratrain/models/family.py), or None."""
        return None

    def replica_states(self, numel: int, layout, params) -> tuple[int, str] | None:
        """Memory: (bytes, the estimate's note) of what it keeps beside the model states on a rank holding `numel`
        parameter elements (after tp, pp and FSDP: the rank's own share; a local-SGD round's start weights and outer
        momentum) of `params` ((Param, count, local shape after tp and ep) of the model's table) on `layout`, or
        None."""
        return None

    def optimizer_temporaries(self, params, layout, reduced_grad_bytes, gloo: bool) -> int:
        """Bytes the optimizer step allocates beside the states, for an optimizer the capability brings, on a rank
        holding `params` (the Params of the model's parameter table it holds) on `layout` (a paratrain.layout.Layout):
        `reduced_grad_bytes(some params)` is this rank's bytes of their reduced gradients; `gloo`: the collectives are
        gloo's (a CPU run). The estimator keeps the largest of every term's (0: none)."""
        return 0

    def optimizer_step_s(self, step) -> tuple[float, dict[str, float]] | None:
        """The planner's terms of its optimizer's step on a rank: (seconds of its own work, added to the optimizer
        step's; {label: exposed communication seconds}, printed in the plan's communication breakdown), or None.
        `step` (paratrain.estimate.step_time.OptimizerStep): the candidate, the model's parameters and the cost
        model's prices of matmuls and collectives. Asked of the capabilities the planned optimizer implies."""
        return None

    # -- a memory tier as a capability (CPU offload): where the model states live -----------------------------------
    # A capability with a `layout_item` is a switch a layout's name turns on (`cpuoff=on`, after the memory tiers'
    # items): the planner's candidates carry it (`estimate.step_time.Candidate.capabilities`), the planner tries the
    # layouts it `runs_on` with it when none fits, `paratrain estimate` takes its keys as flags and suggests it.
    layout_item: ClassVar[str] = ""  # its item in a layout's name ("" : none)
    # the planner's tier variants all use it where it runs, rather than trying each layout with and without it (the
    # chunked loss: the head's forward once more buys most of the logits' memory)
    with_every_tier: ClassVar[bool] = False
    host_side: ClassVar[bool] = False  # its terms need the profile's host side (the offloads: the device <-> host link)
    layout_hint: ClassVar[str] = "on"  # what an unknown item's message says its value is (`cpuoff=on`)
    tier_label: ClassVar[str] = ""  # what the estimate says of it among the memory tiers in use
    suggestion: ClassVar[tuple[float, str, str] | None] = None  # a suggestion's (cost rank, flag, what it costs)
    verify_matrix: ClassVar[str] = ""  # the sweep its verify rows join (paratrain/verify.py; "" : its own)
    # the sharded parameters, gradients and optimizer state live in host memory: the optimizer steps there, a CUDA
    # run also needs collectives on host tensors (gloo beside NCCL), the planner's lower bound counts no states
    states_on_host: ClassVar[bool] = False

    @classmethod
    def runs_on(cls, layout) -> bool:
        """Whether a layout can run it (the planner's tier variants, the suggestions)."""
        return True

    def check_layout(self, layout) -> None:
        """Checks against the run's layout: a one-line ConfigError (after the `[memory]` tiers' own: memory.py)."""

    def layout_value(self) -> str:
        """Its item's value in a layout's name (`cpuoff=on`; activation offload's: its mode, every_k with its k; "":
        the name says nothing, the chunked loss left automatic)."""
        return "on"

    @classmethod
    def from_layout_value(cls, value: str, where: str) -> "Capability | None":
        """The capability a layout name's `item=value` turns on (None: the value names it off), or a one-line
        UserError."""
        if value != "on":
            raise UserError(f"{where}: {cls.layout_item} is off unless {cls.layout_item}=on")
        return cls()

    @classmethod
    def tier_state(cls, on: "Capability | None") -> object:
        """What the JSON documents say under its name among the memory tiers (`on`: the run's, or None): on or not
        (activation offload: its mode)."""
        return on is not None

    @classmethod
    def plan_alternative(cls, request, planning, plain):
        """`paratrain plan`: another way to train the request the capability weighs beside the plain plan `plain`, or
        None (local SGD across slow links): an object with `rows` (PlanRows ranked among the plain rows by predicted
        step time; the first row, whichever it is, is the written config), `lines()` (said under the table: why) and
        `as_json()` under its JSON `key`."""
        return None

    def plan_note(self, args) -> str | None:
        """A line `paratrain plan` prints under its header about it, for the model of ModelArgs `args` (None: none)."""
        return None

    def plan_problem(self) -> str | None:
        """Why the planner cannot predict it with these settings (`paratrain plan --explain`), or None."""
        return None

    def check_checkpointing(self, mode: str) -> None:
        """Checks against activation checkpointing's mode (paratrain.modes.CheckpointMode): a one-line ConfigError."""

    def config_values(self) -> dict:
        """{"section.key": value} a config running it says (a layout name's switch: verify's rows, the planner's
        configs); a run without it has its keys' defaults, or its `off_values`."""
        return {}

    @classmethod
    def off_values(cls) -> dict:
        """{"section.key": value} a config without it says where that is not its keys' default (the chunked loss:
        one piece, where the default is automatic)."""
        return {}

    # -- a setting a Recipe gives by name (the chunked loss: always resolved) ----------------------------------------
    # `recipe.<recipe_setting>` reads it (its `tier_state`) and `Recipe.replace(<recipe_setting>=N)` sets it
    # (`from_setting`), so the planner's candidates change it as they change a Recipe field
    recipe_setting: ClassVar[str] = ""

    @classmethod
    def from_setting(cls, value) -> "Capability | None":
        """The capability the recipe setting's `value` is (None: the value turns it off)."""
        return None

    def loss_pieces(self, layout, precision: str, vocab_size: int, tokens: int) -> int:
        """The pieces the output projection and the loss run over for a micro-batch of `tokens` (sequences x sequence
        length on one data-parallel rank, before context parallelism cuts them) of a model of `vocab_size`: the
        trainer's forward (the model's `targets=` and pieces), the estimator's logits. 1: whole."""
        return 1

    def resolved(self, layout, precision: str, vocab_size: int, tokens: int) -> "Capability | None":
        """This capability with its automatic settings decided for the model and a micro-batch (`loss_pieces`' terms;
        None: that turns it off): what the estimator's recipe holds."""
        return self

    def head_recompute_s(self, head_s: float, micro_steps: int) -> float:
        """Time: what backward recomputes of the output head per step (`head_s`: the head's and the loss's forward +
        backward of one micro-step)."""
        return 0.0

    def fsdp_offload_policy(self, where: Where):
        """FSDP2's OffloadPolicy for every `fully_shard` group, or None (torch's default: nothing offloaded)."""
        return None

    def host_states(self, st):
        """Memory: a rank's model states (estimate.model_states.StateBytes) as (what stays on the device, {category:
        bytes in host memory}), or None where it moves none."""
        return None

    def host_optimizer_s(self, opt_params: float, step_bytes: float, hw) -> float | None:
        """Time: the optimizer step of `opt_params` parameters (`step_bytes` each) where it runs it elsewhere, or
        None (the device's)."""
        return None

    def fsdp_copy_s(self, copies: int, shard_bytes: float, hw) -> float:
        """Time: what `copies` FSDP collectives of `shard_bytes` each add besides the collectives, overlappable."""
        return 0.0

    # -- a memory tier as a capability (activation offload): where the blocks' saved activations live ---------------
    copy_label: ClassVar[str] = ""  # the plan's communication breakdown's name of its `host_activation_s` copies

    def host_activations(self, n_layers: int) -> tuple[list[int], int] | None:
        """The blocks (of `n_layers`) whose saved activations it keeps in host memory from their forward to their
        backward, and the distance between two of them (a block's backward fetches the one that far below ahead), or
        None. `parallelize` applies distributed/offload.py's hooks to them; the estimator takes their bytes off the
        device."""
        return None

    def host_activation_s(self, block_bytes: int, moved: int, blocks: int, micro_steps: int, compute_s: float,
                          hw) -> tuple[float, float]:
        """Time: (exposed, total) seconds per step of copying `moved` of a rank's `blocks` blocks' `block_bytes`
        saved activations to host and back (`compute_s`: the rank's compute per micro-step)."""
        return 0.0, 0.0

    # -- a checkpointing mode as a capability: which blocks recompute together ---------------------------------------
    def checkpoint_units(self, blocks: list, n_layers: int) -> list[list] | None:
        """One model's or pipeline stage's `blocks` (of `n_layers`) as its checkpoints group them: each unit keeps
        only its first block's input and recomputes as one, in its last block's backward (the estimator's activation
        walk; `parallelize` applies distributed/parallelize.py's multi-block checkpoint to each), or None: the mode's
        own, one block each."""
        return None

    def checkpointing_label(self) -> str:
        """Its checkpointing mode as a layout's name writes it (the value of `ac=`, with its settings)."""
        return str(self.checkpoint_mode)

    @classmethod
    def parse_checkpointing_label(cls, text: str) -> dict | None:
        """{a Recipe field: its value} (checkpointing, every_k, ...) of a layout name's `ac=` value that names its
        mode, or None."""
        return None

    def describe_checkpointing(self, n_layers: int) -> str:
        """Its checkpointing mode as the estimate's tables say it (with its settings resolved for `n_layers`)."""
        return str(self.checkpoint_mode)
