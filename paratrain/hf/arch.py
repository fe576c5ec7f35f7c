"""Hugging Face config.json <-> paratrain ModelArgs.

paratrain's decoder is transformers' `LlamaForCausalLM` (RMSNorm, grouped-query attention with rotary
embeddings in the split-halves layout, SwiGLU, optional tied embeddings, optional Llama 3.1 "llama3" rope
scaling), and its mixture-of-experts block with softmax routing, top-k >= 2 renormalised gates, no shared
experts and no dense layers is `MixtralForCausalLM`'s. Anything else in a config.json is refused with one
line naming the setting and why; a model paratrain can train but transformers has no class for (shared
experts, sigmoid routing, ...) is refused on export the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.errors import UserError
from paratrain.models.args import (DEFAULT_FAMILY, MAX_COUNT, MAX_DIMENSION, MAX_POSITIONS, MAX_VOCAB, ModelArgs,
                                   is_int, is_number)
from paratrain.models.presets import validate_args, validate_moe
from paratrain.modes import dtype_name

LLAMA, MIXTRAL = "LlamaForCausalLM", "MixtralForCausalLM"
# Architectures read on import. Mistral is Llama's layout with an optional sliding window (refused when set).
IMPORTABLE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral"}
ROPE_TYPES = ("default", "llama3")


def is_hf_folder(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(folder: str | Path) -> dict:
    """config.json of a Hugging Face model folder, or a one-line UserError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"Hugging Face model folder not found: {folder}")
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{folder} is not a Hugging Face model folder: no config.json")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path} is not a JSON object")
    return cfg


def architecture(folder: str | Path) -> str:
    """The importable architecture a Hugging Face folder holds (e.g. LlamaForCausalLM), or a one-line UserError."""
    folder = Path(folder)
    return _architecture(read_hf_config(folder), str(folder / "config.json"))


def _architecture(cfg: dict, where: str) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch is not None and not isinstance(arch, str):
        raise UserError(f"{where}: architectures must be a list of class names, got {archs!r}")
    if arch is None:  # a bare config: the model type says it
        model_type = cfg.get("model_type")
        arch = {v: k for k, v in IMPORTABLE.items()}.get(model_type) if isinstance(model_type, str) else None
    if arch not in IMPORTABLE:
        name = arch or cfg.get("model_type") or "unknown"
        raise UserError(f"{where}: architecture {name} is not supported (paratrain imports "
                        f"{', '.join(IMPORTABLE)})")
    return arch


def _rope(cfg: dict, where: str) -> dict:
    """rope_theta and scaling from either layout: transformers 4 (`rope_theta` + `rope_scaling`) or 5
    (`rope_parameters`)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope scaling '{kind}' is not supported (paratrain implements "
                        f"{' and '.join(ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor={params['partial_rotary_factor']} is not supported "
                        "(paratrain rotates the whole head)")
    out = {}
    if "rope_theta" in params:
        out["rope_theta"] = float(params["rope_theta"])
    if kind == "llama3":
        try:
            out.update(rope_scaling="llama3", rope_scaling_factor=float(params["factor"]),
                       rope_low_freq_factor=float(params["low_freq_factor"]),
                       rope_high_freq_factor=float(params["high_freq_factor"]),
                       rope_original_max_seq_len=int(params["original_max_position_embeddings"]))
        except KeyError as e:
            raise UserError(f"{where}: llama3 rope scaling lacks {e.args[0]}") from None
    return out


_REQUIRED_INTS = {"hidden_size": MAX_DIMENSION, "num_hidden_layers": MAX_COUNT, "num_attention_heads": MAX_COUNT,
                  "intermediate_size": MAX_DIMENSION, "vocab_size": MAX_VOCAB}
_OPTIONAL_INTS = {"num_key_value_heads": MAX_COUNT, "head_dim": MAX_COUNT, "max_position_embeddings": MAX_POSITIONS,
                  "num_local_experts": MAX_COUNT, "num_experts_per_tok": MAX_COUNT, "sliding_window": None}
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "rope_theta")


def _int_problem(key: str, value, upper) -> str | None:
    if not is_int(value) or value < 1 or (upper is not None and value > upper):
        bound = f"from 1 to {upper}" if upper is not None else ">= 1"
        return f"{key} must be an integer {bound}, got {value!r}"
    return None


def check_hf_fields(cfg: dict, where: str) -> None:
    """Every config.json field paratrain reads: its type and range, one line naming it."""
    for key, upper in _REQUIRED_INTS.items():
        problem = _int_problem(key, cfg.get(key), upper)
        if problem:
            raise UserError(f"{where}: {problem}")
    for key, upper in _OPTIONAL_INTS.items():
        if cfg.get(key) is not None and (problem := _int_problem(key, cfg[key], upper)):
            raise UserError(f"{where}: {problem}")
    for key in _POSITIVE_NUMBERS:
        if key in cfg and cfg[key] is not None and not (is_number(cfg[key]) and cfg[key] > 0):
            raise UserError(f"{where}: {key} must be a positive number, got {cfg[key]!r}")
    for key in _BOOLS:
        if key in cfg and cfg[key] is not None and not isinstance(cfg[key], bool):
            raise UserError(f"{where}: {key} must be true or false, got {cfg[key]!r}")
    for key in ("hidden_act", "model_type"):
        if key in cfg and not isinstance(cfg[key], str):
            raise UserError(f"{where}: {key} must be a string, got {cfg[key]!r}")
    if "router_aux_loss_coef" in cfg and not (is_number(cfg["router_aux_loss_coef"])
                                              and cfg["router_aux_loss_coef"] >= 0):
        raise UserError(f"{where}: router_aux_loss_coef must be a number >= 0, got {cfg['router_aux_loss_coef']!r}")
    for table in ("rope_scaling", "rope_parameters"):
        value = cfg.get(table)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UserError(f"{where}: {table} must be an object or null, got {value!r}")
        for key in _ROPE_NUMBERS:
            if key in value and value[key] is not None and not (is_number(value[key]) and value[key] > 0):
                raise UserError(f"{where}: {table}.{key} must be a positive number, got {value[key]!r}")
        if "partial_rotary_factor" in value and not is_number(value["partial_rotary_factor"]):
            raise UserError(f"{where}: {table}.partial_rotary_factor must be a number")
        if value.get("original_max_position_embeddings") is not None and (problem := _int_problem(
                "original_max_position_embeddings", value["original_max_position_embeddings"], MAX_POSITIONS)):
            raise UserError(f"{where}: {table}.{problem}")
        for key in ("rope_type", "type"):
            if key in value and value[key] is not None and not isinstance(value[key], str):
                raise UserError(f"{where}: {table}.{key} must be a string, got {value[key]!r}")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") is None and hidden % heads:
        raise UserError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise UserError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    experts, top_k = cfg.get("num_local_experts"), cfg.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        raise UserError(f"{where}: num_experts_per_tok={top_k} is more than num_local_experts={experts}")


def _refuse_if(condition, where: str, reason: str) -> None:
    if condition:
        raise UserError(f"{where}: {reason}")


def args_from_hf_config(cfg: dict, where: str = "config.json") -> ModelArgs:
    """ModelArgs for a transformers Llama / Mistral / Mixtral config, or a one-line UserError saying what
    paratrain cannot represent."""
    arch = _architecture(cfg, where)
    check_hf_fields(cfg, where)
    _refuse_if(cfg.get("quantization_config"), where, "quantized weights are not supported (dequantize first)")
    _refuse_if(cfg.get("hidden_act", "silu") != "silu", where,
               f"activation '{cfg.get('hidden_act')}' is not supported (paratrain's MLP is SwiGLU with silu)")
    _refuse_if(cfg.get("attention_bias"), where, "attention_bias=true is not supported (paratrain's attention "
               "projections have no bias)")
    _refuse_if(cfg.get("mlp_bias"), where, "mlp_bias=true is not supported (paratrain's MLP has no bias)")
    window, context = cfg.get("sliding_window"), cfg.get("max_position_embeddings") or 0
    _refuse_if(window is not None and window < context, where,
               f"sliding_window={window} is not supported (paratrain attends to the whole context)")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)]
    _refuse_if(missing, where, f"missing or non-integer {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    fields = dict(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads, ffn_hidden=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_seq_len=int(cfg.get("max_position_embeddings") or 2048),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if arch == MIXTRAL else 1e-6)),  # transformers' defaults
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=1e6 if arch == MIXTRAL else 10000.0,
    )
    fields.update(_rope(cfg, where))
    _refuse_if(heads % fields["n_kv_heads"], where,
               f"num_attention_heads={heads} is not a multiple of num_key_value_heads={fields['n_kv_heads']}")
    if arch == MIXTRAL:
        experts, top_k = cfg.get("num_local_experts", 8), cfg.get("num_experts_per_tok", 2)
        _refuse_if(top_k < 2, where, f"num_experts_per_tok={top_k}: Mixtral's top-1 gate is 1, paratrain's is the "
                   "router probability (top_k >= 2 renormalises the same way in both)")
        fields.update(moe_experts=experts, moe_top_k=top_k, moe_ffn_hidden=cfg["intermediate_size"],
                      moe_score_func="softmax", moe_shared_experts=0, moe_first_dense_layers=0,
                      moe_capacity_factor=0.0, moe_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)))
    try:
        args = ModelArgs(**fields)
        validate_args(args)
        validate_moe(args)
    except (TypeError, ValueError, UserError) as e:
        raise UserError(f"{where}: {e}") from None
    return args


def family_mismatch(args: ModelArgs) -> str | None:
    """Why a model's family has no config mapping here (this file maps the Llama family), or None."""
    if args.family != DEFAULT_FAMILY:
        return f"model family '{args.family}' (paratrain maps the {DEFAULT_FAMILY} family to Hugging Face configs)"
    return None


def mixtral_mismatch(args: ModelArgs) -> str | None:
    """Why an MoE model has no MixtralForCausalLM counterpart, or None."""
    reasons = []
    if args.moe_shared_experts:
        reasons.append(f"{args.moe_shared_experts} shared expert(s)")
    if args.moe_first_dense_layers:
        reasons.append(f"{args.moe_first_dense_layers} dense first layer(s)")
    if args.moe_score_func != "softmax":
        reasons.append(f"{args.moe_score_func} routing")
    if args.moe_top_k < 2:
        reasons.append("top-1 routing (Mixtral's single gate is 1, paratrain's the router probability)")
    if not reasons:
        return None
    return ", ".join(reasons) + " (MixtralForCausalLM has softmax top-k>=2 routing over routed experts only)"


def hf_config_from_args(args: ModelArgs, vocab_size: int, dtype: str, bos_id: int | None, eos_id: int | None,
                        name: str = "model") -> dict:
    """config.json for a paratrain model: LlamaForCausalLM, or MixtralForCausalLM for an MoE model that maps
    to it (UserError naming what does not). Written in transformers 4's keys (`rope_theta`, `rope_scaling`),
    which transformers 5, vLLM and llama.cpp's converter all read."""
    why = family_mismatch(args) or (args.moe_experts and mixtral_mismatch(args))
    if why:
        raise UserError(f"{name} cannot be exported as a Hugging Face model: it has {why}")
    cfg = {
        "architectures": [MIXTRAL if args.moe_experts else LLAMA],
        "model_type": "mixtral" if args.moe_experts else "llama",
        "vocab_size": vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.expert_hidden if args.moe_experts else args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype_name(dtype),
    }
    if args.rope_scaling == "llama3":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                               "low_freq_factor": args.rope_low_freq_factor,
                               "high_freq_factor": args.rope_high_freq_factor,
                               "original_max_position_embeddings": args.rope_original_max_seq_len}
    if args.moe_experts:
        cfg.update(num_local_experts=args.moe_experts, num_experts_per_tok=args.moe_top_k,
                   router_aux_loss_coef=args.moe_aux_loss_coef, output_router_logits=False, sliding_window=None,
                   router_jitter_noise=0.0)
    else:
        cfg.update(mlp_bias=False, pretraining_tp=1)
    return cfg


def resume_hint(path: Path) -> str | None:
    """Why a Hugging Face folder given as a checkpoint to resume is not one, and what to use."""
    if is_hf_folder(path):
        return f"it is a Hugging Face model folder; start a run from it with --model.init_from=hf:{path}"
    return None
