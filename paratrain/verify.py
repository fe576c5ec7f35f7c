"""`paratrain verify`: the same short training on one process and on each parallel layout, compared step by step.

Every layout sees the same global batches (the loader is a pure function of (seed, step)) and starts
from the same weights (initialisation is per parameter name, not per shard), so in fp32 the only
differences left are the order of floating-point reductions: a correct layout stays within 1e-5.
Then each layout's ranks evaluate the single-process reference's final checkpoint: the same weights on the same
validation sequences, so its val loss must equal the reference's within 1e-6.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field

from paratrain import capabilities
from paratrain.api import launch_ranks, run_rank, train_rank
from paratrain.capabilities.base import MOE_PRESET, RowTerms
from paratrain.config import ParallelConfig, load_config
from paratrain.errors import UserError, did_you_mean
from paratrain.layout_grammar import parse_layout_name
from paratrain.models.registry import verify_rows as family_verify_rows
from paratrain.modes import Precision
from paratrain.recipe import config_default, setting_keys

LONG_MODEL = "model.max_seq_len=1024"  # the tiny model with room for long sequences
QWEN3, QWEN3_MOE = "model.preset=tiny-qwen3", "model.preset=tiny-qwen3-moe"  # q/k norms, q/k/v/o biases, head_dim 32

ROUTING = (MOE_PRESET, "model.moe_experts=8", "model.moe_score_func=sigmoid", "model.moe_n_group=4",
           "model.moe_topk_group=2", "model.moe_routed_scaling_factor=2.5", "model.moe_shared_gate=true")

COMPILE = "training.compile=true"  # each block compiled by Inductor, against one eager process

# name -> (ranks, layout, other overrides..., RowTerms where the row runs its own steps or tolerances: fp8's). The
# layout is written as its name (paratrain/layout_grammar.py): the data-parallel mode, degrees, checkpointing (ac=),
# sequences per micro-batch (mb=; default: the global batch over the data-parallel ranks) and the memory tiers it
# names (the capabilities' switches: the chunked loss's loss=, activation offload's, cpuoff=on; the others keep the
# default); `layout_overrides` turns it into the run's settings.
LAYOUTS: dict[str, tuple] = {
    "ddp2": (2, "ddp"),
    "zero1x2": (2, "zero1"),
    "zero2x2": (2, "zero2"),
    "fsdp2": (2, "fsdp"),
    "fsdp4": (4, "fsdp"),
    "hsdp2x2": (4, "hsdp,rep=2"),
    "tp2": (2, "nodp,tp=2,sp=off"),
    "tp2+sp": (2, "nodp,tp=2"),
    "fsdp2xtp2": (4, "fsdp,tp=2"),
    "fsdp2+every_k": (2, "fsdp,ac=every_k2"),
    "fsdp2+selective": (2, "fsdp,ac=selective"),
    "accum": (1, "nodp,mb=2"),  # micro 2 x accum 4 against micro 8 x accum 1
    # Not in the default matrix, available by name:
    "ddp4": (4, "ddp"),
    "fsdp2+full": (2, "fsdp,ac=full"),
    "tp4": (4, "nodp,tp=4"),
    "ddp2+accum": (2, "ddp,mb=2"),
    # Mixture of experts (preset tiny-moe: a dense layer, then 4 experts top-2 + a shared expert), compared
    # with one process training the same MoE model. ep borrows its ranks from dp_shard.
    "ep2": (2, "fsdp,ep=2", MOE_PRESET),
    "ep4": (4, "fsdp,ep=4", MOE_PRESET),
    "ep2xfsdp2": (4, "fsdp,ep=2", MOE_PRESET),
    "ep2xtp2": (4, "fsdp,tp=2,ep=2", MOE_PRESET),
    "moe-fsdp2": (2, "fsdp", MOE_PRESET),
    "moe-tp2": (2, "nodp,tp=2,sp=off", MOE_PRESET),
    "ep2+selective": (2, "fsdp,ep=2,ac=selective", MOE_PRESET),
    "ep2+accum": (2, "fsdp,ep=2,mb=2", MOE_PRESET),
    "ep2xhsdp2": (4, "hsdp,rep=2,ep=2", MOE_PRESET),
    "ep2+capacity": (2, "fsdp,ep=2", MOE_PRESET, "model.moe_capacity_factor=1.0"),  # tokens dropped per sequence
    # Pipelined (the base's 4 blocks: a dense block and an MoE one per stage); the balance loss trains through the
    # MoE outputs' backward (models/moe.py AuxLossScaler), which the schedule runs from the last stage's loss.
    "moe-pp2-gpipe": (2, "nodp,pp=2,sched=gpipe", MOE_PRESET),
    "moe-pp2-1f1b": (2, "nodp,pp=2,sched=1f1b", MOE_PRESET),
    "moe-pp2-interleaved": (2, "nodp,pp=2,sched=interleaved_1f1b", MOE_PRESET),
    "moe-pp2-zb": (2, "nodp,pp=2,sched=interleaved_zero_bubble", MOE_PRESET),
    "moe-pp2+full": (2, "nodp,pp=2,sched=1f1b,ac=full", MOE_PRESET),
    "moe-pp2xtp2": (4, "nodp,tp=2,pp=2,sched=1f1b", MOE_PRESET),
    "ep2xpp2": (4, "fsdp,ep=2,pp=2,sched=1f1b", MOE_PRESET),
    # DeepSeek-V3's routing (8 sigmoid-scored experts in 4 groups, top-2 within the best 2, gates scaled by 2.5) with
    # Qwen2-MoE's gated shared expert.
    **{f"moe-routing-{name}": (ranks, layout, *ROUTING) for name, ranks, layout in (
        ("fsdp2", 2, "fsdp"), ("tp2", 2, "nodp,tp=2,sp=off"), ("ep2", 2, "fsdp,ep=2"),
        ("ep2xtp2", 4, "fsdp,tp=2,ep=2"))},
    # Pipeline parallelism (the base model has 4 blocks: 2 stages of 2, or 2 ranks x 2 virtual stages of 1).
    "pp2-gpipe": (2, "nodp,pp=2,sched=gpipe"),
    "pp2-1f1b": (2, "nodp,pp=2,sched=1f1b"),
    "pp2-interleaved": (2, "nodp,pp=2,sched=interleaved_1f1b"),
    "pp2-zb": (2, "nodp,pp=2,sched=interleaved_zero_bubble"),
    "pp2-zbv": (2, "nodp,pp=2,sched=zbv"),
    "pp2xdp2": (4, "fsdp,pp=2,sched=1f1b"),
    "pp2xtp2": (4, "nodp,tp=2,pp=2,sched=1f1b"),
    "pp2xdp2xtp2": (8, "fsdp,tp=2,pp=2,sched=1f1b"),
    "pp2+full": (2, "nodp,pp=2,sched=1f1b,ac=full"),
    # Context parallelism: every sequence split over cp ranks (ring attention), FSDP over dp_shard x cp.
    "cp2": (2, "fsdp,cp=2"),
    "cp2xfsdp2": (4, "fsdp,cp=2"),
    "cp2xtp2": (4, "fsdp,cp=2,tp=2"),
    "cp2xpp2": (4, "fsdp,cp=2,pp=2,sched=1f1b"),
    "cp4-seq1024": (4, "fsdp,cp=4", LONG_MODEL, "training.seq_len=1024"),  # the long-sequence row
    "cp4-seq256": (4, "fsdp,cp=4", "training.seq_len=256"),  # a shorter long-sequence row for the test suite
    "cp4": (4, "fsdp,cp=4"),
    "cp2xhsdp2": (4, "hsdp,rep=2,cp=2"),
    "cp2+selective": (2, "fsdp,cp=2,ac=selective"),
    "cp2+full": (2, "fsdp,cp=2,ac=full"),
    "cp2+accum": (2, "fsdp,cp=2,mb=2"),
    # A Qwen3-shaped tiny model (4 blocks; the MoE one routes like Qwen3-MoE, block 1 dense), against one process.
    "qwen3-fsdp2": (2, "fsdp", QWEN3),
    "qwen3-tp2+sp": (2, "nodp,tp=2", QWEN3),
    "qwen3-pp2": (2, "nodp,pp=2,sched=1f1b", QWEN3),
    "qwen3-cp2": (2, "fsdp,cp=2", QWEN3),
    "qwen3-moe-ep2xfsdp2": (4, "fsdp,ep=2", QWEN3_MOE),
    # The model families' and side heads' own rows (`verify_rows`), against one process training the same model.
    **family_verify_rows(),

    # The capabilities that change the model (`verify_matrix` "model": adapters on a frozen tiny model), against one
    # process training the same model.
    **capabilities.verify_rows("model"),
    # The capabilities that are memory tiers (the chunked loss, activation offload, CPU offload) or checkpointing
    # modes, against a reference that computes its loss in 8 pieces (fp32's default)
    **capabilities.verify_rows("memory"),
    # torch.compile (Inductor) against one eager process: alone, under FSDP, with checkpointing, tp, pp and fp8.
    "compile": (1, "nodp", COMPILE),
    "compile-fsdp2": (2, "fsdp", COMPILE),
    "compile-fsdp2+full": (2, "fsdp,ac=full", COMPILE),
    "compile-tp2+sp": (2, "nodp,tp=2", COMPILE),
    "compile-pp2": (2, "nodp,pp=2,sched=1f1b", COMPILE),
    # The capabilities' own rows (paratrain/capabilities: fp8, z-loss, ...), under their names.
    **capabilities.verify_rows(""),
}


def split_row(row: tuple) -> tuple[tuple, RowTerms]:
    """A LAYOUTS row as (ranks, layout, overrides...) and its own terms (RowTerms(): the sweep's)."""
    if row and isinstance(row[-1], RowTerms):
        return row[:-1], row[-1]
    return row, RowTerms()


DEFAULT_MATRIX = ["ddp2", "zero1x2", "zero2x2", "fsdp2", "fsdp4", "hsdp2x2", "tp2", "tp2+sp", "fsdp2xtp2",
                  "fsdp2+every_k", "fsdp2+selective", "accum"]
# Layouts that change the model (model.* overrides) are compared with one process training that model.
MOE_MATRIX = ["ep2", "ep4", "ep2xfsdp2", "ep2xtp2"]
PP_MATRIX = ["pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "pp2-zb", "pp2xdp2", "pp2xtp2", "pp2xdp2xtp2"]
CP_MATRIX = ["cp2", "cp2xfsdp2", "cp2xtp2", "cp2xpp2", "cp4-seq1024"]
QWEN_MATRIX = ["qwen3-fsdp2", "qwen3-tp2+sp", "qwen3-pp2", "qwen3-cp2", "qwen3-moe-ep2xfsdp2"]

MODEL_CAPABILITY_MATRIX = list(capabilities.verify_rows("model"))

MEMORY_MATRIX = list(capabilities.verify_rows("memory"))
# Each capability's rows, by its name (paratrain verify --layouts takes any of them).
CAPABILITY_MATRICES = {cls.name: list(cls.verify_rows) for cls in capabilities.CAPABILITIES}
# Those held to the run's tolerance (fp32's 1e-5): in `paratrain verify`'s default sweep (fp8's, looser, by name)
# (a capability's rows in another sweep, `verify_matrix`, run there)
EXACT_CAPABILITY_ROWS = [row for cls in capabilities.CAPABILITIES if not cls.verify_matrix
                         for row, terms in cls.verify_rows.items() if split_row(terms)[1].tolerance is None]
COMPILE_MATRIX = ["compile", "compile-fsdp2", "compile-fsdp2+full", "compile-tp2+sp", "compile-pp2",
                  "compile-fp8-fsdp2"]

GLOBAL_BATCH = 8
DEFAULT_STEPS = 20  # a row's steps where neither `--steps` nor the row (RowTerms) says
EVAL_SEQUENCES = 13  # not divisible by 2, 4 or 8: the data-parallel shares of the validation set are padded
VAL_TOLERANCE = 1e-6  # one checkpoint's val loss on a layout against one process


def base_overrides(steps: int, out_dir: str, precision: str) -> list[str]:
    """A tiny model, fp32, no checkpoints/samples and only the final evaluation: only the numerics matter here.

    Adam's eps is 1e-6 rather than 1e-8: Adam's first update moves every weight by about lr x g / (|g| + eps), so for
    the few gradient elements near 1e-8 a rounding-level difference (1e-9, as large as one process's own fp32 error
    against float64) would become a weight difference of lr x 1e-2 ~ 1e-5, whatever the layout. Layouts that change
    the attention arithmetic (ring attention under context parallelism) hit that; eps=1e-6 keeps the comparison
    about the layout (it shrinks those differences 40x and changes nothing else)."""
    return ["model.preset=tiny", "model.n_layers=4", f"training.steps={steps}", "training.seq_len=32",
            f"training.global_batch={GLOBAL_BATCH}", f"training.precision={precision}", "training.eval_every=0",
            f"training.eval_sequences={EVAL_SEQUENCES}", "optimizer.warmup_steps=2", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
            "optimizer.eps=1e-6",
            "checkpoint.save_final=false", "sample.max_new_tokens=0", "metrics.progress=none",
            "metrics.peak_tflops=1", f"run.out_dir={out_dir}"]


@dataclass(frozen=True)
class Resumed:
    """A row that trains on the layout of `row` (a LAYOUTS row, whose model and settings both halves share) with a
    checkpoint at half the steps, then resumes from it on `then`, (ranks, layout name), for the rest: the run's state
    (weights, optimizer, data position, buffers such as the MoE routing bias) must move between layouts exactly. The
    first layout trains all the steps (the learning rate is a function of the run's total steps, so a shorter run
    would not be the same run); only its losses up to the checkpoint count."""
    row: str
    then: tuple[int, str]


# name -> Resumed, written resume-FIRST:SECOND (':' needs no quoting in a shell, unlike '->'): the capabilities' rows
# whose state must move exactly to a layout that shards it differently (`Capability.resumed_rows`).
RESUMED: dict[str, Resumed] = {name: Resumed(row, then) for name, (row, then) in capabilities.resumed_rows().items()}


def layout_overrides(name: str) -> tuple[int, list[str]]:
    """A row's ranks (a resumed row's: the larger part's) and overrides (a resumed row's: its second part's)."""
    if name in RESUMED:
        (first_ranks, _), (ranks, extra) = resumed_overrides(name)
        return max(first_ranks, ranks), extra
    if name not in LAYOUTS:
        known = [*LAYOUTS, *RESUMED]
        raise UserError(f"unknown layout '{name}'" + (did_you_mean(name, known, cutoff=0.6)
                                                        or f" (known: {', '.join(known)})"))
    return _row_overrides(name, *split_row(LAYOUTS[name])[0])


def row_terms(name: str) -> RowTerms:
    """A row's own steps and tolerances (a resumed row's: its first row's)."""
    return split_row(LAYOUTS[RESUMED[name].row if name in RESUMED else name])[1]


def row_steps(name: str, steps: int | None) -> int:
    """The steps a row runs: the sweep's `steps` where given, else its own, else DEFAULT_STEPS."""
    return steps or row_terms(name).steps or DEFAULT_STEPS


def row_description(name: str) -> str:
    """What a row runs, in one line (`paratrain verify --list`): its ranks, layout name, settings, steps and the
    tolerances of its own (the others: `--tolerance`, 1e-5)."""
    if name in RESUMED:
        resumed = RESUMED[name]
        what = f"row {resumed.row}, then resumed at half its steps on {resumed.then[0]} ranks, {resumed.then[1]}"
    else:
        (ranks, text, *extra), _ = split_row(LAYOUTS[name])
        what = f"{ranks} rank{'s' if ranks > 1 else ''}, {text}" + (f", {' '.join(extra)}" if extra else "")
    terms = row_terms(name)
    own = terms.tolerance
    within = "" if own is None else f", within {own[0]:.0e} (loss, val loss) and {own[1]:.0e} (weights)"
    return f"{what}; {terms.steps or DEFAULT_STEPS} steps{within}"


def resumed_overrides(name: str) -> tuple[tuple[int, list[str]], tuple[int, list[str]]]:
    """A resumed row's two parts, (ranks, overrides) each: its first row's, and its second layout with that row's
    model and settings."""
    resumed = RESUMED[name]
    _, _, *extra = split_row(LAYOUTS[resumed.row])[0]
    return layout_overrides(resumed.row), _row_overrides(name, *resumed.then, *extra)


def _row_overrides(name: str, nproc: int, text: str, *extra: str) -> tuple[int, list[str]]:
    named = parse_layout_name(text, f"verify layout {name}")
    layout = named.layout(nproc)
    parallel, default = layout.to_config(ParallelConfig()), ParallelConfig()
    changed = [f"parallel.{key}={value}" for key, value in dataclasses.asdict(parallel).items()
               if value != getattr(default, key)]
    keys = setting_keys()  # (the settings it names other than the micro-batch: checkpointing, the loss's chunks)
    changed += [f"{keys[name]}={value}" for name, value in named.settings.items()
                if name != "micro_batch" and value != config_default(keys[name])]
    changed += [f"{key}={value}" for key, value in named.switch_values().items()]  # the tiers it switches on
    micro_batch = named.settings.get("micro_batch", GLOBAL_BATCH // layout.dp)
    return nproc, [*changed, f"training.micro_batch={micro_batch}", *extra]


@dataclass
class Row:
    layout: str
    ranks: int
    max_loss_diff: float
    max_weight_diff: float
    val_diff: float  # |val loss of the reference's final checkpoint on this layout - on one process|
    seconds: float
    passed: bool
    note: str = ""
    losses: list[float] = field(default_factory=list)


def train_and_evaluate(train_cfg, eval_cfg):
    """What each launched rank of a layout runs: the training (its result, with the final weights), then, by the same
    process group, the evaluation of the reference's final checkpoint (its val loss)."""
    return run_rank(train_cfg, True, keep_group=True), run_rank(eval_cfg).val_loss


def train_and_evaluate_all(pairs: list):
    """train_and_evaluate for several layouts of one world size, one after the other by the same launched ranks."""
    import torch._dynamo  # lazy: verify's checks before launch answer without torch (a rank has it: its preload)

    out = []
    for i, (train_cfg, eval_cfg) in enumerate(pairs):
        # Each layout compiles as in a process of its own: the blocks' forward keeps dynamo's compiled entries of the
        # layouts before (other tensor types), and past config.recompile_limit (8: the fourth compiled layout) dynamo
        # would run it eager. Inductor's caches on disk are kept (the same graphs load, not compile).
        torch._dynamo.reset()
        result = run_rank(train_cfg, True, keep_group=True)
        out.append((result, run_rank(eval_cfg, keep_group=i < len(pairs) - 1).val_loss))
    return out


def layout_configs(name: str, extra: list[str], base: list[str], extra_args: list[str], checkpoint) -> tuple:
    """A layout's training config and the config that evaluates the reference's checkpoint on it (resumed at the
    last step: nothing left to train)."""
    run_name = name.replace("+", "_")
    overrides = base + extra + [f"run.name={run_name}"] + list(extra_args)
    evaluation = [f"run.name={run_name}-eval", f"checkpoint.resume={checkpoint}", "training.eval_every=1"]
    return load_config(None, overrides), load_config(None, overrides + evaluation)


def _run_layout(train_cfg, eval_cfg, nproc: int, halt=lambda: None):
    if nproc == 1:
        result = train_rank(train_cfg, want_final_weights=True)
        halt()  # (a stop that ended the training early: no evaluation)
        return result, train_rank(eval_cfg).val_loss
    return launch_ranks(train_and_evaluate, (train_cfg, eval_cfg), nproc)


def _train(cfg, nproc: int):
    if nproc == 1:
        return train_rank(cfg)
    return launch_ranks(run_rank, (cfg,), nproc)


def _run_resumed(name: str, steps: int, base: list[str], extra_args: list[str], checkpoint, halt=lambda: None):
    """A resumed row: its first layout trains with a checkpoint at step steps // 2, its second resumes from that
    checkpoint to the end and evaluates the reference's checkpoint. Returns (the result with both parts' losses, the
    second part's val loss)."""
    (first_ranks, first_extra), (ranks, extra) = resumed_overrides(name)
    half, run_name = steps // 2, name.replace(":", "-to-")
    first_cfg, _ = layout_configs(f"{run_name}-first", first_extra, base, [
        *extra_args, f"checkpoint.every={half}", f"checkpoint.keep={steps}"], checkpoint)  # (step-half kept)
    first = _train(first_cfg, first_ranks)
    halt()
    resume = f"checkpoint.resume={first_cfg.run_dir / 'checkpoints' / f'step-{half}'}"
    result, val_loss = _run_layout(*layout_configs(run_name, extra, base, [*extra_args, resume], checkpoint), ranks,
                                   halt)
    return dataclasses.replace(result, losses=first.losses[:half] + result.losses), val_loss


def compare(reference, result) -> tuple[float, float]:
    steps = len(reference.losses)
    if len(result.losses) != steps:
        return float("inf"), float("inf")
    loss_diff = max(abs(a - b) for a, b in zip(reference.losses, result.losses))
    weight_diff = 0.0
    for key, ref in reference.final_weights.items():
        got = result.final_weights.get(key)
        if got is None or got.shape != ref.shape:
            return loss_diff, float("inf")
        weight_diff = max(weight_diff, (got.float() - ref.float()).abs().max().item())
    return loss_diff, weight_diff


def reference_overrides(layout_extra: list[str]) -> list[str]:
    """The model settings, sequence length, optimizer and capabilities a layout changes (e.g. the MoE preset, a long
    sequence, an optimizer, adapters): its reference is one process training that model on those sequences with
    it."""
    kept = [o for o in layout_extra if o.startswith(("model.", "training.seq_len=", "optimizer.",
                                                     *capabilities.reference_keys()))]
    for cls in capabilities.CAPABILITIES:  # (fp8's scales are taken per forward: the reference runs the same forwards)
        if cls.uses(layout_extra) and cls.reference_micro_batch:
            kept.append(f"training.micro_batch={cls.reference_micro_batch}")
    return kept


def row_tolerances(name: str, tolerance: float, val_tolerance: float) -> tuple[float, float, float]:
    """(loss, weight, val loss) tolerances of a row: the run's, or looser where the row says so (fp8's)."""
    out, own = (tolerance, tolerance, val_tolerance), row_terms(name).tolerance
    return out if own is None else tuple(max(a, b) for a, b in zip(out, own))


def check_rows(layouts: list[str], steps: int | None) -> None:
    """Unknown row names, and resumed rows with no step to resume at, as one-line errors."""
    for name in layouts:
        layout_overrides(name)
    if any(name in RESUMED and row_steps(name, steps) < 2 for name in layouts):
        raise UserError("resumed rows (resume-*) need --steps >= 2")


class Stopped(KeyboardInterrupt):
    """A sweep stopped by a signal (SIGINT, SIGTERM): the rows it finished before, and the signal. An interrupt, so
    everything between the check that raises it and the caller lets it pass (errors.translated, the launcher)."""

    def __init__(self, signum: int, rows: list):
        super().__init__(signum)
        self.signum, self.rows = signum, rows


class _Sweep:
    """One sweep's temporary folder, its base settings per number of steps and its single-process references."""

    def __init__(self, out_dir: str, precision: str, extra_args: list[str], echo, halt):
        self.out_dir, self.precision, self.extra_args, self.echo, self.halt = out_dir, precision, extra_args, echo, halt
        self.bases: dict[int, list[str]] = {}
        self.references: dict[tuple, tuple] = {}
        self.ref_seconds = 0.0

    def base(self, n: int) -> list[str]:
        """The base overrides of the rows that run n steps."""
        return self.bases.setdefault(n, base_overrides(n, self.out_dir, self.precision))

    def reference(self, model_overrides: list[str], n: int):
        """One single-process reference per model (the dense tiny model, or e.g. the MoE preset) and number of steps,
        with its final checkpoint (which every layout of that model evaluates) and that checkpoint's val loss."""
        # (a key the command line sets, `--set model.preset=...`, is its value for every row: one reference)
        given = {o.split("=", 1)[0] for o in self.extra_args}
        key = tuple(o for o in model_overrides if o.split("=", 1)[0] not in given)
        if (n, key) not in self.references:
            start = time.perf_counter()
            run_name = f"reference{n}" + "".join("_" + o.split("=", 1)[1] for o in key)
            cfg = load_config(None, self.base(n) + [f"training.micro_batch={GLOBAL_BATCH}", *key,
                                                    f"run.name={run_name}", *self.extra_args,
                                                    "checkpoint.save_final=true"])
            result = train_rank(cfg, want_final_weights=True)
            self.halt()
            seconds = time.perf_counter() - start
            self.ref_seconds += seconds
            self.echo(f"reference{' (' + ' '.join(key) + ')' if key else ''}: 1 process, {n} steps, final loss "
                      f"{result.losses[-1]:.6f}, val loss {result.val_loss:.6f} ({seconds:.1f}s)")
            self.references[n, key] = result, cfg.run_dir / "checkpoints" / f"step-{n}"
        return self.references[n, key]

    def shared_launches(self, layouts: list[str], steps: int | None) -> dict:
        """Every layout of one world size in one launch of the ranks (the tests' matrices): name -> ((result, val
        loss) or the launch's UserError, seconds per layout)."""
        groups, shared = {}, {}
        for name in layouts:
            nproc, extra = layout_overrides(name)
            n = row_steps(name, steps)
            _, checkpoint = self.reference(reference_overrides(extra), n)
            if nproc > 1 and name not in RESUMED:  # (a resumed row launches its two parts itself)
                groups.setdefault(nproc, []).append((name, layout_configs(name, extra, self.base(n), self.extra_args,
                                                                          checkpoint)))
        for nproc, members in groups.items():
            self.halt()
            start = time.perf_counter()
            try:
                outcome = launch_ranks(train_and_evaluate_all, ([pair for _, pair in members],), nproc)
            except UserError as e:
                outcome = [e] * len(members)
            seconds = (time.perf_counter() - start) / len(members)
            shared.update({name: (got, seconds) for (name, _), got in zip(members, outcome)})
        return shared


def run_verify(layouts: list[str], steps: int | None, tolerance: float, precision: str = "fp32",
               extra_args: list[str] = (), echo=print, val_tolerance: float = VAL_TOLERANCE,
               share_launches: bool = False, stopped=lambda: None) -> tuple[list[Row], float]:
    """steps: every row's (None: each row's own, `row_steps`).
    share_launches: run all layouts of one world size in one launch of the ranks, one after the other in one process
    group (the test suite's matrices: the ranks' start-up is paid once per world size; a layout that fails then fails
    the others of its launch too, so `paratrain verify` launches each on its own).
    stopped: the signal that asked the sweep to stop, or None; once it says one, the sweep raises Stopped at its next
    check (after each training, before each row is judged: a row cut short is not a row that failed), its temporary
    folder removed."""
    check_rows(layouts, steps)  # bad names fail before anything runs
    rows: list[Row] = []

    def halt():
        signum = stopped()
        if signum is not None:
            raise Stopped(signum, rows)

    with tempfile.TemporaryDirectory(prefix="paratrain-verify-") as out_dir:
        sweep = _Sweep(out_dir, precision, list(extra_args), echo, halt)
        shared = sweep.shared_launches(layouts, steps) if share_launches else {}
        for name in layouts:
            halt()
            nproc, extra = layout_overrides(name)
            n = row_steps(name, steps)
            base = sweep.base(n)
            reference, checkpoint = sweep.reference(reference_overrides(extra), n)
            start = time.perf_counter()
            try:
                if name in shared:
                    got, seconds = shared[name]
                    start -= seconds
                    if isinstance(got, UserError):
                        raise got
                    result, val_loss = got
                elif name in RESUMED:
                    result, val_loss = _run_resumed(name, n, base, extra_args, checkpoint, halt)
                else:
                    result, val_loss = _run_layout(*layout_configs(name, extra, base, extra_args, checkpoint), nproc,
                                                   halt)
                loss_diff, weight_diff = compare(reference, result)
                val_diff = abs(val_loss - reference.val_loss)
                note, losses = "", result.losses
            except UserError as e:
                loss_diff = weight_diff = val_diff = float("inf")
                note, losses = str(e) or "ranks failed (see above)", []
            halt()  # (a row the stop cut short, killed ranks included, is no result)
            loss_tol, weight_tol, val_tol = row_tolerances(name, tolerance, val_tolerance)
            passed = loss_diff <= loss_tol and weight_diff <= weight_tol and val_diff <= val_tol
            rows.append(Row(name, nproc, loss_diff, weight_diff, val_diff, time.perf_counter() - start, passed, note,
                            losses))
            echo(format_row(rows[-1], tolerance, judged=not Precision(precision).low_precision))
    return rows, sweep.ref_seconds


HEADER = f"{'layout':<18} {'ranks':>5} {'max |dloss|':>12} {'max |dweight|':>14} {'|dval|':>9} {'time':>7}  result"


def format_row(r: Row, tolerance: float, judged: bool = True) -> str:
    verdict = ("PASS" if r.passed else "FAIL") if judged else ("reported" if r.note == "" else "FAIL")
    note = f"  ({r.note})" if r.note else ""
    return f"{r.layout:<18} {r.ranks:>5} {r.max_loss_diff:>12.2e} {r.max_weight_diff:>14.2e} {r.val_diff:>9.2e} {r.seconds:>6.1f}s  {verdict}{note}"

