"""`paratrain eval SOURCE --tasks T1,T2`: lm-evaluation-harness's tasks on a checkpoint, a run's newest checkpoint or
a Hugging Face folder (hf:DIR), on one process or on N local ranks in any layout (`--parallel.tp=2`, ...).

Everything is checked before a rank starts: lm-eval installed, the tasks known and their data readable, the counts,
the layout against the model and the world size. The results are lm-eval's own files (results_*.json, and
samples_*.jsonl with --log-samples) under --output-path (default: RUN_DIR/eval for a run's checkpoint), and its table
on stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

from paratrain.commands.train import int_flag, split_overrides
from paratrain.errors import UserError

USAGE = """usage: paratrain eval CHECKPOINT|RUN_DIR|hf:DIR --tasks T1,T2 [--include-path DIR] [--num-fewshot N]
                      [--limit N] [--batch-size N] [--output-path DIR] [--log-samples] [--bootstrap-iters N]
                      [--max-length N] [--nproc N] [--oversubscribe] [--parallel.KEY=VALUE ...]
                      [--training.precision=fp32|bf16|fp16] [--training.device=auto|cpu|cuda]

  CHECKPOINT|RUN_DIR   a step-N checkpoint folder, or a run folder (its newest intact checkpoint)
  hf:DIR               a Hugging Face model folder (config.json, safetensors, tokenizer.json)
  --tasks T1,T2        lm-eval task (or group) names
  --include-path DIR   a folder of task YAML files of your own (local data; its !function entries are code)
  --num-fewshot N      few-shot examples per request (default: each task's own)
  --limit N            documents per task (default: all)
  --batch-size N       requests per forward (default 8)
  --output-path DIR    where lm-eval's results files go (default: RUN_DIR/eval, or ./eval for hf:DIR)
  --log-samples        also write every request and its answer (samples_TASK_*.jsonl)
  --bootstrap-iters N  bootstrapped standard errors (default 0: none)
  --max-length N       tokens per request, longest first truncated on the left (default: the model's context)
  --nproc N            local ranks; the layout comes from --parallel.* (data-parallel ranks take what is left)

Examples: paratrain eval runs/default --tasks shakespeare --nproc 2 --parallel.tp=2   (the bundled tasks, from
          paratrain/assets/eval_tasks; lm-eval's own by their names: --tasks hellaswag,arc_easy)
          paratrain eval runs/default --tasks my_task --include-path DIR   (DIR/*.yaml: your own tasks)
"""

FLAGS = {"--tasks", "--include-path", "--num-fewshot", "--limit", "--batch-size", "--output-path",
         "--bootstrap-iters", "--max-length", "--nproc", "--seed"}
SWITCHES = ("--log-samples", "--oversubscribe")
SECTIONS = ("parallel.", "training.precision=", "training.device=", "activation_checkpoint.", "memory.")


def default_output(source_text: str, source) -> Path:
    if source.hf:
        return Path("eval")
    run = source.path.parent.parent if source.path.parent.name == "checkpoints" else source.path.parent
    return run / "eval"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0].startswith("--"):
        split_overrides([a for a in argv if a not in SWITCHES], FLAGS, SWITCHES)  # a mistyped option: its one line
        raise UserError("the first argument is what to evaluate: a checkpoint, a run folder or hf:DIR")
    source_text, rest = argv[0], argv[1:]
    own, overrides = split_overrides([a for a in rest if a not in SWITCHES], FLAGS, SWITCHES)
    for item in overrides:
        if not item.startswith(SECTIONS):
            raise UserError(f"--{item.split('=')[0]} is a training setting; eval takes --parallel.*, "
                            "--training.precision, --training.device, --activation_checkpoint.*, --memory.*")
    if "--tasks" not in own:
        raise UserError("--tasks is required (e.g. --tasks hellaswag,arc_easy)")
    # lazy: torch and lm-eval are not needed for --help and the argument errors above
    from paratrain.config import load_config
    from paratrain.harness.tasks import HarnessSettings, check_settings

    cfg = load_config(None, overrides)
    nproc = int_flag(own, "--nproc", 1)
    if nproc < 1:
        raise UserError("--nproc must be >= 1")
    max_length = int_flag(own, "--max-length", 0) or None
    if max_length is not None and max_length < 2:
        raise UserError(f"--max-length must be at least 2, got {max_length}")
    settings = HarnessSettings(
        tasks=[t for t in own["--tasks"].split(",") if t], include_path=own.get("--include-path", ""),
        num_fewshot=int_flag(own, "--num-fewshot", 0) if "--num-fewshot" in own else None,
        limit=int_flag(own, "--limit", 0) if "--limit" in own else None,
        batch_size=int_flag(own, "--batch-size", 8), bootstrap_iters=int_flag(own, "--bootstrap-iters", 0),
        log_samples="--log-samples" in rest)
    # lazy: torch is not needed for --help and the argument errors above
    from paratrain.downstream import EvalJob, eval_rank, open_source
    from paratrain.layout import Layout

    notices = []
    source = open_source(source_text, notice=notices.append)
    for line in notices:
        print(line, file=sys.stderr, flush=True)
    Layout.from_config(cfg.parallel, nproc).validate(source.model_args, nproc)
    context = source.model_args.max_seq_len
    if max_length is not None and max_length > context:  # the model has no positions past its context
        raise UserError(f"--max-length {max_length} is longer than the model's context ({context} tokens)")
    settings.output_path = own.get("--output-path") or str(default_output(source_text, source))
    check_settings(settings)
    job = EvalJob(str(source.path) if not source.hf else source.name, settings, cfg, max_length,
                  int_flag(own, "--seed", 0))
    print(f"eval: {source.name}" + (f" (step {source.step})" if source.step is not None else "")
          + f" on {nproc} rank{'s' if nproc > 1 else ''}, tasks {','.join(settings.tasks)}", file=sys.stderr, flush=True)
    if nproc == 1:
        outcome = eval_rank(job)
    else:
        # lazy: only a launch needs the launcher
        from paratrain.api import launch_ranks
        from paratrain.preflight import check_nproc

        check_nproc(cfg.training.device, nproc, "--oversubscribe" in rest)
        outcome = launch_ranks(eval_rank, (job,), nproc)
    print(outcome["table"])
    print(f"{outcome['requests']:,} requests in {outcome['seconds']:.1f} s "
          f"({outcome['requests'] / max(outcome['seconds'], 1e-9):,.1f}/s)"
          + (f"; results: {outcome['path']}" if outcome["path"] else ""), file=sys.stderr)
    return 0
