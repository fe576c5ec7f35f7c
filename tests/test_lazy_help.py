"""Flag help made when argparse reads it (config_reference.LazyHelp): building a command's flags describes nothing,
--help shows what `describe` says."""

import argparse

from paratrain import config_reference
from paratrain.commands.recipe_flags import add_recipe_flags
from paratrain.config import TrainingConfig
from paratrain.layout_grammar import add_layout_flags, flag_help


def test_flags_are_described_only_for_help(monkeypatch):
    calls = []
    real = config_reference.describe
    monkeypatch.setattr("paratrain.commands.recipe_flags.describe", lambda *a: calls.append(a) or real(*a))
    parser = argparse.ArgumentParser(prog="x", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_recipe_flags(parser, only=("training.tf32",))
    add_layout_flags(parser, keys=("tp", "sequence_parallel"))
    parser.parse_args(["--tf32", "true", "--tp", "2"])
    assert calls == []
    text = " ".join(parser.format_help().split())
    assert calls == [("training", TrainingConfig, "tf32")]
    for described in (real("training", TrainingConfig, "tf32"), flag_help("tp"), flag_help("sequence_parallel")):
        assert " ".join(described.replace("%%", "%").split()) in text
