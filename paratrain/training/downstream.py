"""`[eval]` during training: lm-eval's tasks on the run's own model and layout every `eval.every` steps and at the
end, their metrics in the run's records (metrics.jsonl's `downstream`, TensorBoard, Prometheus) and the final
results as lm-eval's files in RUN_DIR/eval, the same files `paratrain eval` writes for the final checkpoint."""

from __future__ import annotations

from paratrain.harness.model import ParatrainLM
from paratrain.harness.tasks import downstream_metrics, evaluate, run_settings, table, write_results


class DownstreamEval:
    def __init__(self, train_step, tokenizer, spec, dims, is_main: bool):
        self.train_step, self.tokenizer, self.spec, self.dims = train_step, tokenizer, spec, dims
        self.is_main = is_main
        self.table: str | None = None  # lm-eval's table of the last evaluation (rank 0)

    def __call__(self, step: int, final: bool = False) -> dict | None:
        """{task: {metric: value}} after `step` steps on rank 0 (None on the other ranks, which take part); at the
        end (`final`) lm-eval's results files too."""
        cfg, args = self.spec.cfg, self.spec.model_args
        settings = run_settings(cfg.eval, str(cfg.run_dir / "eval") if final else "")
        lm = ParatrainLM(self.train_step, self.tokenizer, args.max_seq_len, settings.batch_size, self.spec.layout.dp,
                         self.dims.dp_rank, args.vocab_size)
        describe = {"checkpoint": str(cfg.run_dir / "checkpoints" / f"step-{step}"), "step": step,
                    "layout": self.spec.layout.describe(), "precision": cfg.training.precision}
        results = evaluate(lm, settings, describe)
        if results is None or not self.is_main:
            return None
        if final:
            write_results(results, settings)
        self.table = table(results)
        return downstream_metrics(results)
