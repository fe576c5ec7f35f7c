"""`paratrain eval`'s ranks (imported by the command once its arguments passed: lm-eval and torch): the model of a checkpoint or a Hugging Face folder on the asked layout, then lm-eval.

The weights land on the layout the way training's do: the step is built by `build_train_step` (the model on the
meta device, laid out, materialised), a checkpoint is read by DCP onto it whatever layout saved it, a Hugging Face
folder by the importer; a LoRA checkpoint gets its base from its source and its adapters from the checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from paratrain import hf
from paratrain.config import Config
from paratrain.data import load_tokenizer
from paratrain.data.tokenizers import HFTokenizer
from paratrain.distributed.env import init_distributed, shutdown_distributed
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import unwrap
from paratrain.errors import UserError, translated
from paratrain.harness.model import ParatrainLM
from paratrain.harness.tasks import HarnessSettings, downstream_metrics, evaluate, table, write_results
from paratrain.hf.load import check_tokenizer_fits, checked_weights, hf_model_args, hf_tokenizer_file
from paratrain.inference import find_checkpoint
from paratrain.layout import Layout
from paratrain.capabilities.grad_compression import Compression
from paratrain.models import ModelArgs
from paratrain.recipe import Recipe
from paratrain.training import safe_dcp
from paratrain.training.adapters import AdaptedCheckpoint
from paratrain.training.checkpoint import load_checkpoint, load_trainer_state
from paratrain.training.step import StepOptions, build_train_step


@dataclass
class EvalSource:
    """What is evaluated: a checked checkpoint folder (step-N) or a Hugging Face folder, its model and tokenizer."""
    path: Path
    hf: bool
    model_args: object  # ModelArgs
    step: int | None
    lora: object = None  # AdaptedCheckpoint of a LoRA checkpoint; None: every weight is in the source

    @property
    def name(self) -> str:
        return f"hf:{self.path}" if self.hf else str(self.path)


def open_source(text: str, notice=None) -> EvalSource:
    """`paratrain eval`'s first argument: hf:DIR, a step-N checkpoint, or a run folder (its newest intact one)."""

    if text.startswith("hf:"):
        folder = Path(text[3:])
        if not (folder / "config.json").is_file():
            raise UserError(f"{text}: no Hugging Face model there (config.json is missing)")
        args = hf_model_args(folder)
        checked_weights(folder, args)
        return EvalSource(folder, True, args, None)
    ckpt = find_checkpoint(text, warn=notice)
    state = load_trainer_state(ckpt)
    if "model_args" not in state:
        raise UserError(f"{ckpt}: trainer.pt has no model dimensions")
    return EvalSource(ckpt, False, ModelArgs(**state["model_args"]), int(state["step"]),
                      AdaptedCheckpoint.of(ckpt, state))


def source_tokenizer(source: EvalSource):

    if source.hf:
        tokenizer = HFTokenizer.from_file(hf_tokenizer_file(source.path))
        check_tokenizer_fits(tokenizer, source.model_args, hf_tokenizer_file(source.path))
        return tokenizer
    return load_tokenizer(source.path)


def load_weights(train_step, source: EvalSource) -> None:
    """The source's weights onto the laid-out model (a collective: every rank calls it)."""

    model = train_step.model
    if source.hf:
        hf.load_initial_weights(unwrap(model), source.path, source.model_args)
        return
    if source.lora is not None and source.lora.hf_folder is not None:  # the base first; the adapters below
        hf.load_initial_weights(unwrap(model), source.lora.hf_folder, source.model_args)

    def unloadable(error: BaseException) -> UserError:
        if isinstance(error, safe_dcp.MetadataProblem):
            return UserError(f"{source.path}: {error}")
        return UserError(f"{source.path}: cannot load model weights ({type(error).__name__})")

    with translated(unloadable):
        load_checkpoint(source.path, model, None)


@dataclass
class EvalJob:
    source: str
    settings: HarnessSettings
    # the run's settings (paratrain.config.Config: --config and --set): [parallel], the device, and how the model
    # computes (precision, TF32, checkpointing, memory tiers, capabilities); the defaults: fp32 on one rank
    config: Config = field(default_factory=Config)
    max_length: int | None = None  # None: the model's context (its export's max_position_embeddings)
    seed: int = 0

    def recipe(self, layout: Layout, lora, device_type: str) -> Recipe:
        """How the model computes on `layout`: the config's recipe (paratrain.recipe.Recipe) for forwards of one
        sequence at a time as built, with the source's adapters, not compiled, and without gradient compression
        (nothing is reduced)."""
        recipe = Recipe.from_config(self.config, layout, 1, 1, device_type)
        return recipe.replace(lora=lora, compile=False, cuda_graphs=False, compression=Compression())


def describe(source: EvalSource, layout, precision: str) -> dict:
    return {"checkpoint": source.name, "step": source.step, "layout": layout.describe(), "precision": precision}


def eval_rank(job: EvalJob) -> dict | None:
    """One rank of `paratrain eval`; rank 0 writes lm-eval's files under the output path and returns
    {"table": lm-eval's table, "metrics": {task: {metric: value}}, "path": the results file or None, "requests":
    lm-eval's requests answered, "seconds": the evaluation's wall time (the model loaded)}."""

    source = open_source(job.source)
    env = init_distributed(job.config.training.device)
    args = source.model_args
    # forwards only: no global batch decides a pipeline's microbatches (lm-eval's batches go through whole)
    layout = Layout.from_config(job.config.parallel, env.world_size).validate(args, env.world_size).forward_only()
    dims = ParallelDims.build(layout, env.device.type)
    seed = source.lora.seed if source.lora is not None else job.seed
    recipe = job.recipe(layout, source.lora.lora if source.lora is not None else None, env.device.type)
    train_step = build_train_step(args, dims, recipe, env.device, StepOptions(seed=seed))
    load_weights(train_step, source)
    lm = ParatrainLM(train_step, source_tokenizer(source), job.max_length or args.max_seq_len,
                     job.settings.batch_size, layout.dp, dims.dp_rank, args.vocab_size, seed=job.seed)
    started = time.perf_counter()
    results = evaluate(lm, job.settings, describe(source, layout, job.config.training.precision))
    seconds = time.perf_counter() - started
    outcome = None
    if env.is_main:
        path = write_results(results, job.settings)
        outcome = {"table": table(results), "metrics": downstream_metrics(results), "path": path and str(path),
                   "requests": lm.requests_answered, "seconds": seconds}
    shutdown_distributed()
    return outcome
