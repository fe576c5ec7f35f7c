"""Evaluation is layout-independent: one checkpoint's val loss is the same (1e-6) on one process and on every layout.

The set is `training.eval_sequences` fixed sequences (here 13: not divisible by 2 or 4, so the data-parallel shares
are padded), split over the data-parallel ranks. The layouts load one checkpoint (a dense one, and a mixture of
experts one for ep) and only evaluate it (resumed at their last step); each group of layouts shares one launch.
"""

from __future__ import annotations

import pytest

from conftest import fast_config
from paratrain.api import run_rank, train_rank
from paratrain.config import load_config
from paratrain.distributed.launch import launch
from paratrain.errors import ConfigError
from paratrain.training.evaluation import eval_share

TOL = 1e-6
SEQUENCES = 13
MOE = ["model.preset=tiny-moe", "model.n_layers=2"]
TWO_RANKS = {"ddp2": ["parallel.dp_mode=ddp"], "fsdp2": ["parallel.dp_mode=fsdp"], "zero1x2": ["parallel.dp_mode=zero1"],
             "tp2+sp": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"],
             "ep2": [*MOE, "parallel.ep=2"]}
FOUR_RANKS = {"fsdp4": ["parallel.dp_mode=fsdp"], "fsdp2xtp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
              "pp2xdp2": ["parallel.pp=2"], "cp2xtp2": ["parallel.cp=2", "parallel.tp=2"]}


def _val_losses(*cfgs):
    """Every config run one after the other by the same launched ranks; rank 0's val losses."""
    return [run_rank(cfg, keep_group=i < len(cfgs) - 1).val_loss for i, cfg in enumerate(cfgs)]


def test_eval_share_pads_to_equal_shares():
    shares = [eval_share(13, 4, r) for r in range(4)]
    assert shares == [(0, 4, 4), (4, 4, 4), (8, 4, 4), (12, 4, 1)]
    assert [eval_share(3, 4, r)[2] for r in range(4)] == [1, 1, 1, 0]
    assert sum(eval_share(240, 7, r)[2] for r in range(7)) == 240


def test_eval_batches_names_its_replacement():
    with pytest.raises(ConfigError, match="'training.eval_batches' is now 'training.eval_sequences'"):
        load_config(None, ["training.eval_batches=20"])


def test_one_checkpoint_scores_the_same_on_every_layout(char_data, tmp_path):
    runs = {}
    for model, extra in (("dense", []), ("moe", MOE)):  # one checkpoint each, trained by one process
        train_rank(fast_config(char_data, tmp_path, f"train-{model}", "training.steps=3", "training.eval_every=0",
                               *extra))
        runs[model] = tmp_path / f"train-{model}" / "checkpoints" / "step-3"

    def evaluation(name, extra):
        ckpt = runs["moe" if any(o.startswith("model.preset=tiny-moe") for o in extra) else "dense"]
        return fast_config(char_data, tmp_path, name.replace("+", "_"), "training.steps=3", "training.eval_every=1",
                           f"training.eval_sequences={SEQUENCES}", f"checkpoint.resume={ckpt}",
                           "checkpoint.save_final=false", "training.micro_batch=3", *extra)

    reference = {model: train_rank(evaluation(f"one-{model}", [] if model == "dense" else MOE)).val_loss
                 for model in runs}
    got = dict(zip(TWO_RANKS, launch(_val_losses, tuple(evaluation(n, o) for n, o in TWO_RANKS.items()), 2)))
    got.update(zip(FOUR_RANKS, launch(_val_losses, tuple(evaluation(n, o) for n, o in FOUR_RANKS.items()), 4)))
    for name, value in got.items():
        want = reference["moe" if name.startswith("ep") else "dense"]
        assert abs(value - want) <= TOL, (name, value, want)
