"""The memory tiers (paratrain/memory.py, README "Memory tiers"): each is an exact transformation of the step, so its
`paratrain verify` rows match one process at 1e-5; their rules and one-line refusals."""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.layout import Layout
from paratrain.memory import AUTO_LOSS_CHUNKS, loss_chunks
from paratrain.verify import MEMORY_MATRIX

from test_distributed import check_matrix


def test_verify_memory_matrix(char_data):
    check_matrix(MEMORY_MATRIX, char_data)


def test_chunked_loss_is_the_whole_loss_and_its_gradients():
    """Pieces that do not divide the tokens; the loss, every gradient and the per-token losses agree."""
    from paratrain.models import build_model
    from paratrain.models.presets import preset_args

    torch.manual_seed(0)
    model = build_model(preset_args("tiny", vocab_size=64))
    x, y = torch.randint(0, 64, (3, 10)), torch.randint(0, 64, (3, 10))
    results = []
    for chunks in (1, 7):
        model.zero_grad()
        loss = model(x, targets=y, loss_chunks=chunks)
        loss.backward()
        with torch.no_grad():
            per_token = model(x, targets=y, loss_chunks=chunks, reduction="none")
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, per_token))
    (l1, g1, t1), (l7, g7, t7) = results
    assert torch.allclose(l1, l7, atol=1e-6) and torch.allclose(t1, t7, atol=1e-6)
    assert all(torch.allclose(g1[n], g7[n], atol=1e-7) for n in g1)


def test_loss_chunks_rules():
    plain, pipeline = Layout.resolve(1), Layout.resolve(2, pp=2)
    assert loss_chunks(0, plain, "fp32") == AUTO_LOSS_CHUNKS  # exact: on by default
    assert loss_chunks(0, plain, "bf16") == 1  # the output weight's gradient would be summed in bf16
    assert loss_chunks(4, plain, "bf16") == 4
    assert loss_chunks(0, pipeline, "fp32") == 1
    with pytest.raises(ConfigError, match="memory.loss_chunks=4 does not work with parallel.pp > 1"):
        loss_chunks(4, pipeline, "fp32")
