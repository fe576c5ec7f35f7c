"""The estimate as text: the table `paratrain estimate` prints (and the trainer logs), one row per memory category."""

from __future__ import annotations

from paratrain import capabilities
from paratrain.estimate.gpus import GB, fmt_bytes, verdict_text
from paratrain.estimate.model_states import model_params
from paratrain.models.presets import count_active_params, format_params
from paratrain.modes import describe_checkpointing

ROWS = [  # (key, label)
    ("parameters", "parameters"),
    ("frozen", "frozen parameters (LoRA base)"),
    ("gradients", "gradients"),
    ("optimizer", "optimizer states"),
    ("master", "fp32 master weights"),
    ("autocast_copies", "autocast 16-bit weight copies"),  # (bf16 or fp16: the run's precision)
    ("activations", "activations (blocks)"),
    ("pipeline", "pipeline in-flight micro-batches"),
    ("logits_loss", "logits and loss"),
    ("comm_buffers", "communication buffers"),
    ("compression", "gradient compression state"),
    ("replica_states", "local SGD round-start weights + outer state"),
    ("temporaries", "backward/optimizer temporaries"),
    ("overhead", "runtime overhead (CUDA, NCCL)"),
]


def lora_text(i) -> str:
    """'; LoRA rank r on wq,...: N trainable, M frozen' for an estimate with adapters ('' without)."""
    if i.recipe.lora is None:
        return ""
    params = model_params(i.model_args, i.recipe.lora)
    trainable = sum(p.numel for p in params if p.trainable)
    return (f"; LoRA rank {i.recipe.lora.rank} on {','.join(i.recipe.lora.targets)}: {format_params(trainable)} "
            f"trainable ({trainable:,}), {format_params(sum(p.numel for p in params) - trainable)} frozen")
def tiers_text(i) -> str:
    """The memory tiers the inputs use, in words ("" for none)."""
    return ", ".join(c.tier_label for c in i.recipe.capabilities if c.tier_label)  # (chunked loss, offloads)


def _host_and_time(s: dict, fb) -> str:
    """A suggestion's host memory per rank and predicted slowdown, where known."""
    out = f", host {fb(s['host_bytes'])} per rank" if s.get("host_bytes") else ""
    if s.get("slowdown") is not None:
        out += f", {s['slowdown']:.2f}x the GPU time per token of the layout as asked"
    return out


def format_table(est, units: str = "GiB") -> str:
    """An Estimate (core.py) as the table `paratrain estimate` prints: categories at the peak and their own maxima, the total
    against the GPU, notes, the classic ZeRO breakdown and the change that would fit."""
    i, lay = est.inputs, est.inputs.layout
    fb = lambda n: fmt_bytes(n, units)  # noqa: E731
    n_params = sum(p.numel for p in model_params(i.model_args))
    owner = capabilities.checkpointing(i.recipe.capabilities)  # (a mode that is a capability says itself)
    mode = (owner.describe_checkpointing(i.model_args.n_layers) if owner is not None
            else describe_checkpointing(i.recipe.checkpointing, i.recipe.every_k))
    active = count_active_params(i.model_args)
    per_token = f", {format_params(active)} active per token ({active:,})" if active != n_params else ""
    lines = [f"model {i.model_name}: {format_params(n_params)} parameters ({n_params:,}){per_token}" + lora_text(i),
             f"layout {lay.describe()} | {i.recipe.precision} ("
             f"{'classic mixed-precision accounting' if i.accounting == 'classic' else 'as paratrain trains it'})"
             f" | {i.recipe.optimizer} ({i.recipe.optimizer_impl}) | checkpointing {mode}",
             f"micro-batch {i.recipe.micro_batch} x seq {i.recipe.seq_len}"
             + (f" x accumulation {i.recipe.accum_steps}" if lay.pp == 1 and i.recipe.accum_steps > 1 else "")
             + (f" | pipeline {lay.pp_schedule}, {lay.pp_microbatches} micro-batches" if lay.pp > 1 else "")
             + (f" | memory tiers: {tiers_text(i)}" if tiers_text(i) else "")]
    where = f"peak: {est.phase}" + (f" on pipeline stage {est.stage} (worst of {lay.pp})" if lay.pp > 1 else "")
    lines.append(f"per rank ({'worst rank' if lay.world_size > 1 else 'one rank'}), {where}; units {units} "
                 f"({'2^30' if units == 'GiB' else '10^9'} bytes)")
    w = 40
    lines.append(f"  {'':<{w}} {'at peak':>12} {'its max':>12}")
    for key, label in ROWS:
        at, size = est.at_peak.get(key, 0), est.sizes.get(key, 0)
        if key == "master" and not (i.accounting == "classic" and i.recipe.precision.low_precision):
            label = label + (" (= the fp32 params)" if i.recipe.precision.low_precision else " (none: fp32)")
        if key == "parameters" and i.recipe.lora is not None:
            label = "trainable parameters (adapters)"
        if not at and not size and key not in ("parameters", "gradients", "optimizer", "master", "activations"):
            continue
        lines.append(f"  {label:<{w}} {fb(at):>12} {fb(size):>12}")
    lines.append(f"  {'-' * (w + 26)}")
    lines.append(f"  {'total':<{w}} {fb(est.total_bytes):>12}"
                 f"   (sum of the maxima: {fb(sum(est.sizes.values()))})")
    if est.gpu_bytes is not None:
        name = f"{i.target.gpu_name} " if i.target.gpu_name else ""
        lines.append(f"  {'GPU memory ' + name:<{w}} {fb(est.gpu_bytes):>12}")
        lines.append(f"  {f'usable ({1 - i.target.headroom:.0%})':<{w}} {fb(est.usable_bytes):>12}")
        lines.append(f"  {'left below the limit':<{w}} {fb(est.headroom_bytes):>12}")
        lines.append(f"  => {verdict_text(est.total_bytes, est.gpu_bytes, i.target.headroom, units)}")
    if est.host:
        parts = ", ".join(f"{dict(ROWS).get(k, k)} {fb(v)}" for k, v in est.host.items())
        lines.append(f"  host memory per rank: {fb(est.host_bytes)} ({parts}); per node ({i.node_ranks} ranks): "
                     f"{fb(est.host_node_bytes)}")
        if i.target.host_bytes is not None:
            word = "FITS" if est.host_fits else "DOES NOT FIT"
            lines.append(f"  => host {word}: {fb(est.host_node_bytes)} of {fb(i.target.host_bytes)} per node "
                         f"({100 * est.host_node_bytes / i.target.host_bytes:.0f}%, {est.host_limit_text})")
    lines.append(f"  {est.memory_line()}")
    if lay.pp > 1 and est.stages:
        lines.append("  per pipeline stage: " + ", ".join(
            f"{s['stage']}: {fb(s['total_bytes'])}" for s in est.stages))
    for note in est.notes:
        lines.append(f"  note: {note}")
    if est.zero:
        lines.append("")
        lines.append(f"classic mixed-precision model states (bf16 params/grads, fp32 master + moments; GB = 10^9 B), "
                     f"ZeRO over {est.zero_ranks} ranks:")
        lines.append(f"  {'':<26} {'1 rank':>10} {'ZeRO-1':>10} {'ZeRO-2':>10} {'ZeRO-3':>10}")
        for row in est.zero:
            lines.append(f"  {row['row']:<26} " + " ".join(
                f"{row[k] / GB:>7.2f} GB" for k in row if k != "row"))  # one rank, then ZeRO-1, 2, 3
    if est.fits is False and est.searched:
        lines.append("")
        if est.suggestion:
            s = est.suggestion
            lines.append(f"would fit: {s['change']} -> {fb(s['total_bytes'])} of {fb(est.gpu_bytes)}, within "
                         f"{fb(est.usable_bytes)}{_host_and_time(s, fb)} (cost: {s['why']})")
            for alt in est.alternatives[:4]:
                lines.append(f"  also fits: {alt['change']} -> {fb(alt['total_bytes'])}{_host_and_time(alt, fb)}")
        else:
            lines.append("nothing tried fits (more sharding, tp, pp, checkpointing, smaller micro-batch, and "
                         "pairs of them): this model needs more GPUs or more memory per GPU")
    return "\n".join(lines)
