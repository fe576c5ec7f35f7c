"""Named model sizes. Llama dimensions are the published ones (Meta's params.json); the MoE presets use the
published dimensions of Mixtral-8x7B and DeepSeekMoE-16B; the Qwen presets those of the official checkpoints'
config.json (Qwen/Qwen2.5-7B, Qwen/Qwen3-8B, ...)."""

from __future__ import annotations

import dataclasses

from paratrain.errors import ConfigError, UserError, did_you_mean
from paratrain.models.args import ROPE_SCALINGS, SCORE_FUNCS, ModelArgs, fields_problem
from paratrain.models.registry import attention_shape, block_numels, get_family, parameters, side_blocks, used_numel

LLAMA3_VOCAB = 128256
LLAMA31_ROPE = dict(norm_eps=1e-5, rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_seq_len=8192)
LLAMA32_ROPE = dict(LLAMA31_ROPE, rope_scaling_factor=32.0)

# vocab_size None means "take it from the prepared dataset" (small models trained on our corpora).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=None, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=256),
    # nanoGPT's CPU recipe for tinyshakespeare (4 layers, 4 heads, width 128, context 64),
    # with a SwiGLU hidden size chosen to match its 4*C two-matrix MLP in parameters.
    "shakespeare-char": dict(vocab_size=None, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=352, max_seq_len=256),
    # Meta's Llama 3 family (params.json / Hugging Face config.json). Llama 3 (8B, 70B): 8k context, no rotary
    # scaling. Llama 3.1 (8B, 70B, 405B) and 3.2 (1B, 3B): 128k context through rope_type "llama3" scaling
    # (factor 8 for 3.1, 32 for 3.2, from an original 8192), norm eps 1e-5, 3.2 with tied embeddings.
    "llama3.2-1b": dict(vocab_size=LLAMA3_VOCAB, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                        max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True, **LLAMA32_ROPE),
    "llama3.2-3b": dict(vocab_size=LLAMA3_VOCAB, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden=8192,
                        max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True, **LLAMA32_ROPE),
    "llama3-8b": dict(vocab_size=LLAMA3_VOCAB, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                      max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=LLAMA3_VOCAB, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                       max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": dict(vocab_size=LLAMA3_VOCAB, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                        max_seq_len=8192, rope_theta=500000.0),
    "llama3.1-8b": dict(vocab_size=LLAMA3_VOCAB, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                        max_seq_len=131072, rope_theta=500000.0, **LLAMA31_ROPE),
    "llama3.1-70b": dict(vocab_size=LLAMA3_VOCAB, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                         max_seq_len=131072, rope_theta=500000.0, **LLAMA31_ROPE),
    "llama3.1-405b": dict(vocab_size=LLAMA3_VOCAB, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                          ffn_hidden=53248, max_seq_len=131072, rope_theta=500000.0, **LLAMA31_ROPE),
    # Mixture of experts. tiny-moe is for tests and `paratrain verify`: one dense layer, then 4 experts
    # (top-2) plus a shared expert.
    "tiny-moe": dict(vocab_size=None, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=256,
                     moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_ffn_hidden=64, moe_first_dense_layers=1),
    # Mixtral-8x7B (Mistral's params.json): 8 experts of width 14336, top-2, every layer.
    # 46,702,792,704 parameters (published 46.7B), 12,879,925,248 active per token (12.9B).
    "mixtral-8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                         max_seq_len=32768, rope_theta=1e6, moe_experts=8, moe_top_k=2, moe_ffn_hidden=14336),
    # DeepSeekMoE-16B (deepseek-ai/deepseek-moe-16b-base config.json): fine-grained experts (64 of width 1408,
    # top-6) plus 2 shared experts, layer 0 dense (10944). Its attention is plain multi-head, which ours
    # expresses exactly (n_kv_heads = n_heads). Differences: DeepSeekMoE does not renormalise the top-k gates
    # (we do) and uses norm eps 1e-6. 16,375,728,128 parameters (published 16.4B), 2,828,650,496 active (2.8B).
    "deepseek-moe-16b": dict(vocab_size=102400, dim=2048, n_layers=28, n_heads=16, n_kv_heads=16, ffn_hidden=10944,
                             max_seq_len=4096, norm_eps=1e-6, moe_experts=64, moe_top_k=6, moe_shared_experts=2,
                             moe_ffn_hidden=1408, moe_first_dense_layers=1, moe_aux_loss_coef=0.001),
    # Multi-head latent attention (family "deepseek", models/deepseek.py) for tests and `paratrain verify`: the
    # shape of DeepSeek-V3's attention at width 64 (q and kv latents of rank 32, per head 16 + 8 rotary q/k, 16 v),
    # a dense layer, then 4 experts top-2 with sigmoid scores and a shared expert.
    "tiny-mla": dict(family="deepseek", vocab_size=None, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8,
                     ffn_hidden=176, max_seq_len=256, norm_eps=1e-6, mla_q_lora_rank=32, mla_kv_lora_rank=32,
                     mla_qk_nope_head_dim=16, mla_qk_rope_head_dim=8, mla_v_head_dim=16, moe_experts=4, moe_top_k=2,
                     moe_shared_experts=1, moe_ffn_hidden=64, moe_first_dense_layers=1, moe_score_func="sigmoid"),
    # DeepSeek-V3 in small, for tests and docs: MLA, 1 dense block then MoE blocks of 8 routed experts top-2 in 4 groups
    # (the best 2) with a shared expert, sigmoid scores, routed scaling 2.5, the expert bias (auxiliary-loss-free
    # balancing, `[moe] balancing = "auto"`) beside a tiny sequence-wise balance loss, one multi-token prediction depth.
    "tiny-deepseek": dict(family="deepseek", vocab_size=None, dim=64, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=8,
                          ffn_hidden=176, max_seq_len=256, norm_eps=1e-6, mla_q_lora_rank=32, mla_kv_lora_rank=32,
                          mla_qk_nope_head_dim=16, mla_qk_rope_head_dim=8, mla_v_head_dim=16, moe_experts=8,
                          moe_top_k=2, moe_n_group=4, moe_topk_group=2, moe_shared_experts=1, moe_ffn_hidden=32,
                          moe_first_dense_layers=1, moe_score_func="sigmoid", moe_routed_scaling_factor=2.5,
                          moe_expert_bias=True, moe_aux_loss_coef=0.0001, mtp_depth=1),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; max_position_embeddings 4096 for planning, the published 163840
    # is yarn-scaled rotary, which paratrain does not implement): MLA (q rank 1536, kv rank 512, 128 + 64 rotary q/k
    # and 128 v per head), 3 dense layers (18432) then 58 of 256 routed experts (2048) top-8 in 8 groups (best 4) and
    # a shared one, sigmoid scores, the expert bias, routed scaling 2.5. The table counts 671,026,404,352 parameters
    # (published 671B) and 37,552,282,624 active (37B), both with the routers, without the expert bias; the MTP
    # module (mtp_depth 1, ~14B more: published 685B with it) is not in the table.
    "deepseek-v3-671b": dict(family="deepseek", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                             head_dim=64, ffn_hidden=18432, max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-6,
                             mla_q_lora_rank=1536, mla_kv_lora_rank=512, mla_qk_nope_head_dim=128,
                             mla_qk_rope_head_dim=64, mla_v_head_dim=128, moe_experts=256, moe_top_k=8,
                             moe_shared_experts=1, moe_ffn_hidden=2048, moe_first_dense_layers=3,
                             moe_score_func="sigmoid", moe_n_group=8, moe_topk_group=4, moe_routed_scaling_factor=2.5,
                             moe_expert_bias=True, moe_aux_loss_coef=0.0001, mtp_depth=1),
    # Qwen (the official checkpoints' config.json on the Hugging Face hub: hidden_size, intermediate_size,
    # num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size, max_position_embeddings,
    # rope_theta, rms_norm_eps, tie_word_embeddings; for the MoE models num_experts, num_experts_per_tok,
    # moe_intermediate_size, norm_topk_prob=true, decoder_sparse_step=1, mlp_only_layers=[]). The counts below are
    # count_params of these shapes; the model cards publish them rounded ("Number of Parameters"), and Qwen2.5-7B's
    # safetensors index gives the exact one (total_size 15,231,233,024 bf16 bytes = 7,615,616,512 parameters).
    # Qwen2.5-7B: q/k/v biases, 28 heads of 128, 7,615,616,512 parameters (published 7.61B, 6.53B non-embedding).
    "qwen2.5-7b": dict(family="qwen2", vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       ffn_hidden=18944, max_seq_len=131072, rope_theta=1e6, norm_eps=1e-6),
    # Qwen3: per-head q/k norms, head_dim 128 whatever the width. Qwen3-8B: 8,190,735,360 (published 8.2B, 6.95B
    # non-embedding); Qwen3-32B (head_dim * heads = 8192 > hidden 5120): 32,762,123,264 (published 32.8B, 31.2B).
    "qwen3-8b": dict(family="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                     head_dim=128, ffn_hidden=12288, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-32b": dict(family="qwen3", vocab_size=151936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8,
                      head_dim=128, ffn_hidden=25600, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6),
    # Qwen3-MoE: 128 routed experts, top-8 with renormalised gates, no shared expert, every block sparse.
    # Qwen3-30B-A3B: 30,532,122,624 parameters, 3,353,032,704 active (published 30.5B total, 3.3B activated, 29.9B
    # non-embedding); Qwen3-235B-A22B: 235,093,634,560 and 22,190,763,520 (published 235B, 22B, 234B).
    "qwen3-30b-a3b": dict(family="qwen3", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, ffn_hidden=6144, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                          moe_experts=128, moe_top_k=8, moe_ffn_hidden=768, moe_aux_loss_coef=0.001),
    "qwen3-235b-a22b": dict(family="qwen3", vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                            head_dim=128, ffn_hidden=12288, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                            moe_experts=128, moe_top_k=8, moe_ffn_hidden=1536, moe_aux_loss_coef=0.001),
    # Qwen3-shaped tiny models for tests and `paratrain verify`: q/k norms and biases on q/k/v/o (family qwen3-bias),
    # a head_dim (32) that is not dim / n_heads (16); the MoE one routes like Qwen3-MoE (4 experts, top-2, no shared
    # expert) with block 1 dense (mlp_only_layers=[1]).
    "tiny-qwen3": dict(family="qwen3-bias", vocab_size=None, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                       ffn_hidden=176, max_seq_len=256, norm_eps=1e-6),
    "tiny-qwen3-moe": dict(family="qwen3-bias", vocab_size=None, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=32, ffn_hidden=176, max_seq_len=256, norm_eps=1e-6, moe_experts=4, moe_top_k=2,
                           moe_ffn_hidden=64, moe_dense_layers=(1,)),
}


def preset_fields(name: str) -> dict:
    if name not in PRESETS:
        hint = did_you_mean(name, PRESETS, cutoff=0.6) or f" (known: {', '.join(PRESETS)})"
        raise UserError(f"unknown model preset '{name}'{hint}")
    return dict(PRESETS[name])


def preset_args(name: str, vocab_size: int | None = None, **overrides) -> ModelArgs:
    fields = preset_fields(name)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if fields["vocab_size"] is None:
        if vocab_size is None:
            raise UserError(f"preset '{name}' takes its vocab size from the dataset; none was given")
        fields["vocab_size"] = vocab_size
    args = ModelArgs(**fields)
    get_family(args.family)  # a one-line error for an unknown family
    validate_args(args)
    validate_moe(args)
    problem = fields_problem(dataclasses.asdict(args), "model.")  # every other field's type and range (args.py)
    if problem:
        raise ConfigError(problem)
    return args


def validate_args(args: ModelArgs) -> None:
    """One-line errors for impossible dense-model settings (named by their config keys)."""
    if args.head_dim < 2 or args.head_dim % 2:
        raise ConfigError(f"model.head_dim={args.head_dim} must be even and >= 2 (rotary embeddings rotate pairs)")
    if args.norm_eps <= 0:
        raise ConfigError(f"model.norm_eps must be positive, got {args.norm_eps}")
    if args.rope_scaling not in ROPE_SCALINGS:
        raise ConfigError(f"model.rope_scaling: '{args.rope_scaling}' is not one of {', '.join(ROPE_SCALINGS)}")
    if args.rope_scaling == "llama3":
        if args.rope_scaling_factor <= 0 or args.rope_original_max_seq_len < 1:
            raise ConfigError("model.rope_scaling_factor and model.rope_original_max_seq_len must be positive")
        if not 0 < args.rope_low_freq_factor < args.rope_high_freq_factor:
            raise ConfigError(f"model.rope_low_freq_factor={args.rope_low_freq_factor} must be positive and below "
                              f"model.rope_high_freq_factor={args.rope_high_freq_factor}")


def validate_moe(args: ModelArgs) -> None:
    """One-line errors for impossible mixture-of-experts settings (named by their config keys)."""
    if args.moe_experts < 0:
        raise ConfigError(f"model.moe_experts must be >= 0 (0: dense), got {args.moe_experts}")
    if not args.moe_experts:
        return
    if not 1 <= args.moe_top_k <= args.moe_experts:
        raise ConfigError(f"model.moe_top_k={args.moe_top_k} must be between 1 and model.moe_experts={args.moe_experts}")
    if args.moe_score_func not in SCORE_FUNCS:
        raise ConfigError(f"model.moe_score_func: '{args.moe_score_func}' is not one of {', '.join(SCORE_FUNCS)}")
    for key in ("moe_shared_experts", "moe_first_dense_layers", "moe_aux_loss_coef", "moe_capacity_factor"):
        if getattr(args, key) < 0:
            raise ConfigError(f"model.{key} must be >= 0, got {getattr(args, key)}")
    if args.moe_ffn_hidden is not None and args.moe_ffn_hidden < 1:
        raise ConfigError(f"model.moe_ffn_hidden must be positive, got {args.moe_ffn_hidden}")
    E, groups, best = args.moe_experts, args.moe_n_group, args.moe_topk_group
    if groups < 1 or E % groups:
        raise ConfigError(f"model.moe_n_group={groups} must divide model.moe_experts={E}")
    if not 1 <= best <= groups:
        raise ConfigError(f"model.moe_topk_group={best} must be between 1 and model.moe_n_group={groups}")
    if args.moe_top_k > best * E // groups:
        raise ConfigError(f"model.moe_top_k={args.moe_top_k} is more than the {best * E // groups} experts of "
                          f"model.moe_topk_group={best} group(s) of {E // groups}")
    if args.moe_routed_scaling_factor <= 0:
        raise ConfigError(f"model.moe_routed_scaling_factor must be positive, got {args.moe_routed_scaling_factor}")
    if args.moe_shared_gate and not args.moe_shared_experts:
        raise ConfigError("model.moe_shared_gate=true gates the shared experts: set model.moe_shared_experts >= 1")
    outside = next((i for i in args.moe_dense_layers if not 0 <= i < args.n_layers), None)
    if outside is not None:
        raise ConfigError(f"model.moe_dense_layers: {outside} is not a block of the {args.n_layers}-block model")


def block_param_count(args: ModelArgs, index: int, active: bool = False) -> int:
    """Parameters of block `index`, from the family's parameter table (`models/family.py`).

    active=True counts what one token uses: the router, the shared experts and top_k of the routed experts."""
    return block_numels(args)[index][active]


def count_params(args: ModelArgs, include_embedding: bool = True, active: bool = False) -> int:
    """Exact parameter count from the family's parameter table, without building the model.

    active=True counts what one token uses: in MoE layers the router, the shared experts and top_k of the
    routed experts instead of all of them (the same as the total for a dense model).
    """
    blocks = sum(block_param_count(args, i, active) for i in range(args.n_layers))
    # (outside the blocks: the side heads' modules, whose blocks may hold routed experts)
    outside = sum(used_numel(args, p) if active else p.numel for p in parameters(args)
                  if p.layer is None and (include_embedding or p.where != "embedding"))
    return blocks + outside


def format_params(n: int) -> str:
    """A parameter count for headers: `0.11M`, `124.4M`, `6.74B` (B from 1e9 up, M below)."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def count_active_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Parameters used per token: shared + top_k routed experts in MoE layers; the total for a dense model."""
    return count_params(args, include_embedding, active=True)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N for the matmuls, plus causal-free attention 12 L C T (C: the
    attention's `score_width`, dim for grouped-query attention, heads x (q/k + v width) / 2 for latent attention).

    The PaLM appendix convention, as used by nanoGPT and torchtitan, so MFU figures are comparable.
    N counts the parameters a token is multiplied by: the active ones for a mixture of experts. The side heads'
    blocks (`registry.side_blocks`) each add their modules (in N), one more pass through the shared output head, and
    the block's attention.
    """
    # The input lookup does no matmul; a tied embedding does, as the output projection.
    side = side_blocks(args)
    n = count_active_params(args, include_embedding=args.tie_embeddings) + side * args.vocab_size * args.dim
    return 6 * n + 12 * (args.n_layers + side) * attention_shape(args).score_width * seq_len
