"""`paratrain plan`: rank parallel layouts by predicted step time, write the best as a config and a launch command.

    paratrain plan --model llama3-8b --gpus 8 --gpus-per-node 8 --gpu H100 --seq 8192 --global-batch-tokens 1048576
    paratrain plan --calibrate --name mybox --nproc 4        # measure this machine; later: --gpu mybox
    paratrain plan ... --explain fsdp,tp=2,ac=full,mb=1     # why a layout is rejected, or how it ranks

Public API: hardware.resolve_hardware / calibrate, cost.predict (the documented cost model), search.plan /
rank_all / explain; the command line (cli.py): main_plan, context_from_argv, write_outputs (TOML + launch command).
"""

from __future__ import annotations

from paratrain.planner.cli import (build_context, config_for, context_from_argv, job_name, launch_command, main_plan,
                                   plan_json, write_outputs)

__all__ = ["build_context", "context_from_argv", "main_plan", "write_outputs", "config_for", "launch_command",
           "job_name", "plan_json"]
