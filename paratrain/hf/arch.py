"""Hugging Face config.json <-> paratrain ModelArgs, for every transformers architecture a model family declares
(`ModelFamily.hf_archs`, each a `paratrain.models.family.HFArch`): LlamaForCausalLM, MistralForCausalLM (read only)
and MixtralForCausalLM for the Llama family (models/llama_params.py), Qwen2ForCausalLM, Qwen2MoeForCausalLM,
Qwen3ForCausalLM and Qwen3MoeForCausalLM for the Qwen families (models/qwen_params.py).

What every one of them shares is read here: RMSNorm, grouped-query attention with rotary embeddings in the
split-halves layout, an optional head_dim, SwiGLU, optional tied embeddings, optional Llama 3.1 "llama3" rope
scaling, and for a mixture of experts softmax top-k routing over routed experts (with Qwen2-MoE's gated shared
expert). What differs is the architecture's data (fields with one value, defaults, key names). Anything else in a
config.json is refused with one line naming the setting and why; a model paratrain can train but transformers has no
class for (ungated shared experts, sigmoid or group-limited routing, a family without a Hugging Face counterpart, ...)
is refused on export the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.errors import UserError
from paratrain.models.args import MAX_COUNT, MAX_DIMENSION, MAX_POSITIONS, MAX_VOCAB, ModelArgs, is_int, is_number
from paratrain.models.family import HFArch, ModelFamily
from paratrain.models.presets import validate_args, validate_moe
from paratrain.models.registry import FAMILIES, family_of
from paratrain.modes import Precision

ROPE_TYPES = ("default", "llama3")


def hf_architectures() -> dict[str, list[tuple[ModelFamily, HFArch]]]:
    """Architecture name -> the (family, architecture) pairs that read it, in registry order."""
    out: dict[str, list] = {}
    for family in FAMILIES.values():
        for arch in family.hf_archs:
            out.setdefault(arch.name, []).append((family, arch))
    return out


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
    known = hf_architectures()
    if arch is None:  # a bare config: the model type says it
        model_type = cfg.get("model_type")
        by_type = {a.model_type: name for name, pairs in known.items() for _, a in pairs}
        arch = by_type.get(model_type) if isinstance(model_type, str) else None
    if arch not in known:
        name = arch or cfg.get("model_type") or "unknown"
        raise UserError(f"{where}: architecture {name} is not supported (paratrain imports {', '.join(known)})")
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
                  "num_local_experts": MAX_COUNT, "num_experts": MAX_COUNT, "num_experts_per_tok": MAX_COUNT,
                  "moe_intermediate_size": MAX_DIMENSION, "decoder_sparse_step": MAX_COUNT, "sliding_window": None,
                  "shared_expert_intermediate_size": MAX_DIMENSION}
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_sliding_window", "qkv_bias",
          "rope_interleave")
# Counts that may be 0 or null (DeepSeek-V3's: no shared expert, no dense first block, no query latent, ...).
_COUNTS = {"n_shared_experts": MAX_COUNT, "first_k_dense_replace": MAX_COUNT, "n_routed_experts": MAX_COUNT,
           "n_group": MAX_COUNT, "topk_group": MAX_COUNT, "q_lora_rank": MAX_DIMENSION, "kv_lora_rank": MAX_DIMENSION,
           "qk_nope_head_dim": MAX_COUNT, "qk_rope_head_dim": MAX_COUNT, "v_head_dim": MAX_COUNT,
           "num_nextn_predict_layers": MAX_COUNT}
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
        if key == "sliding_window" and cfg.get(key) == 0 and cfg.get("use_sliding_window") is False:
            continue  # Qwen2MoeConfig saves 0 for "no window"
        if cfg.get(key) is not None and (problem := _int_problem(key, cfg[key], upper)):
            raise UserError(f"{where}: {problem}")
    for key, upper in _COUNTS.items():
        value = cfg.get(key)
        if value is not None and not (is_int(value) and 0 <= value <= upper):
            raise UserError(f"{where}: {key} must be an integer from 0 to {upper}, got {value!r}")
    for key in _POSITIVE_NUMBERS:
        if key in cfg and cfg[key] is not None and not (is_number(cfg[key]) and cfg[key] > 0):
            raise UserError(f"{where}: {key} must be a positive number, got {cfg[key]!r}")
    for key in _BOOLS:
        if key in cfg and cfg[key] is not None and not isinstance(cfg[key], bool):
            raise UserError(f"{where}: {key} must be true or false, got {cfg[key]!r}")
    for key in ("hidden_act", "model_type"):
        if key in cfg and not isinstance(cfg[key], str):
            raise UserError(f"{where}: {key} must be a string, got {cfg[key]!r}")
    layers = cfg.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list) and all(
            is_int(i) and 0 <= i < cfg["num_hidden_layers"] for i in layers)):
        raise UserError(f"{where}: mlp_only_layers must be a list of layer indices below num_hidden_layers, "
                        f"got {layers!r}")
    kinds = cfg.get("layer_types")
    if kinds is not None and not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
        raise UserError(f"{where}: layer_types must be a list of strings, got {kinds!r}")
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
    for key in ("num_local_experts", "num_experts"):
        experts, top_k = cfg.get(key), cfg.get("num_experts_per_tok")
        if experts is not None and top_k is not None and top_k > experts:
            raise UserError(f"{where}: num_experts_per_tok={top_k} is more than {key}={experts}")


def _refuse_if(condition, where: str, reason: str) -> None:
    if condition:
        raise UserError(f"{where}: {reason}")


def _value(cfg: dict, arch: HFArch, key: str):
    """A config.json field, or transformers' default for it when it is missing or null."""
    return cfg[key] if cfg.get(key) is not None else arch.defaults.get(key)


def _family_for(cfg: dict, name: str, where: str) -> tuple[ModelFamily, HFArch]:
    """The family (and its architecture entry) that computes what this config describes: the first whose fixed fields
    it has (e.g. Qwen3's attention_bias picks qwen3 or qwen3-bias), else a one-line UserError naming the field."""
    pairs = hf_architectures()[name]
    for family, arch in pairs:
        if all(_value(cfg, arch, k) == v for k, v in arch.fixed.items()):
            return family, arch
    _, arch = pairs[0]
    key = next(k for k, v in arch.fixed.items() if _value(cfg, arch, k) != v)
    raise UserError(f"{where}: {key}={json.dumps(_value(cfg, arch, key))} is not supported (paratrain's {name} has "
                    f"{key}={json.dumps(arch.fixed[key])})")


def _moe_fields(cfg: dict, arch: HFArch, where: str) -> dict:
    """The mixture-of-experts dimensions: top-k over routed experts by the architecture's score function, and the
    gated shared expert where the architecture has one (n shared experts of the routed width: its width must be a
    multiple) or its count of ungated ones; the dense blocks of decoder_sparse_step / mlp_only_layers or the dense first
    blocks where the architecture has them; its routing bias."""
    given = [cfg[k] for k in arch.experts_keys if cfg.get(k) is not None]
    experts = given[0] if given else arch.defaults.get(arch.experts_keys[0])
    top_k = _value(cfg, arch, "num_experts_per_tok")
    renormalised = _value(cfg, arch, arch.norm_topk_key) if arch.norm_topk_key else True
    _refuse_if(renormalised and top_k < 2, where, f"num_experts_per_tok={top_k} with renormalised gates: transformers' "
               "single gate is then 1, paratrain's the router probability (top_k >= 2 renormalises the same way)")
    expert_hidden, shared = _value(cfg, arch, arch.expert_hidden_key), 0
    if arch.shared_expert_key:
        width = _value(cfg, arch, arch.shared_expert_key)
        _refuse_if(width % expert_hidden, where, f"{arch.shared_expert_key}={width} is not a multiple of "
                   f"{arch.expert_hidden_key}={expert_hidden} (paratrain's shared experts have the routed width)")
        shared = width // expert_hidden
    if arch.shared_count_key:
        shared = _value(cfg, arch, arch.shared_count_key)
    dense = ()
    if arch.sparse_layers:
        step, only = _value(cfg, arch, "decoder_sparse_step"), cfg.get("mlp_only_layers") or []
        dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)
    return dict(moe_experts=experts, moe_top_k=top_k, moe_ffn_hidden=expert_hidden,
                moe_score_func=arch.score_func, moe_norm_topk=bool(renormalised), moe_shared_experts=shared,
                moe_shared_gate=bool(shared) and arch.shared_expert_key is not None, moe_expert_bias=arch.expert_bias,
                moe_first_dense_layers=_value(cfg, arch, arch.first_dense_key) if arch.first_dense_key else 0,
                moe_dense_layers=dense, moe_capacity_factor=0.0,
                moe_aux_loss_coef=float(_value(cfg, arch, "router_aux_loss_coef")))


def args_from_hf_config(cfg: dict, where: str = "config.json") -> ModelArgs:
    """ModelArgs for a config of any architecture a family declares, or a one-line UserError saying what paratrain
    cannot represent."""
    name = _architecture(cfg, where)
    check_hf_fields(cfg, where)
    family, arch = _family_for(cfg, name, where)
    _refuse_if(cfg.get("quantization_config"), where, "quantized weights are not supported (dequantize first)")
    _refuse_if(cfg.get("hidden_act", "silu") != "silu", where,
               f"activation '{cfg.get('hidden_act')}' is not supported (paratrain's MLP is SwiGLU with silu)")
    window, context = cfg.get("sliding_window"), _value(cfg, arch, "max_position_embeddings")
    if arch.window_flag:  # Qwen: the window applies only when turned on
        _refuse_if(cfg.get(arch.window_flag), where, f"{arch.window_flag}=true is not supported (paratrain attends "
                   "to the whole context)")
    else:
        _refuse_if(window is not None and window < context, where,
                   f"sliding_window={window} is not supported (paratrain attends to the whole context)")
    other = next((k for k in cfg.get("layer_types") or [] if k != "full_attention"), None)
    _refuse_if(other, where, f"layer_types '{other}' is not supported (paratrain's attention is full attention in "
               "every layer)")
    heads = cfg["num_attention_heads"]
    fields = dict(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads, ffn_hidden=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, max_seq_len=int(context),
        norm_eps=float(_value(cfg, arch, "rms_norm_eps")),
        tie_embeddings=bool(_value(cfg, arch, "tie_word_embeddings")),
        rope_theta=float(arch.defaults.get("rope_theta", 10000.0)), family=family.name,
    )
    fields.update(_rope(cfg, where))
    if arch.moe:
        fields.update(_moe_fields(cfg, arch, where))
    for key, names in arch.dims.items():  # a null is 0 (q_lora_rank: no query latent)
        value = cfg[key] if key in cfg else arch.defaults.get(key)
        fields.update({name: value or 0 for name in names})
    try:
        args = ModelArgs(**fields)
        validate_args(args)
        validate_moe(args)
    except (TypeError, ValueError, UserError) as e:
        raise UserError(f"{where}: {e}") from None
    return args


def _export_arch(args: ModelArgs) -> HFArch | None:
    """The architecture a model is written as: its family's exported one with (or without) a mixture of experts."""
    return next((a for a in family_of(args).hf_archs if a.exported and a.moe == bool(args.moe_experts)), None)


def _moe_mismatch(args: ModelArgs, arch: HFArch) -> str | None:
    reasons = []
    if arch.shared_expert_key and not (args.moe_shared_experts and args.moe_shared_gate):
        reasons.append("no gated shared expert" if not args.moe_shared_experts else "ungated shared experts")
    if args.moe_shared_experts and not (arch.shared_expert_key or arch.shared_count_key):
        reasons.append(f"{args.moe_shared_experts} shared expert(s)")
    if arch.shared_count_key and args.moe_shared_gate:
        reasons.append("gated shared experts")
    mapped = {name for names in arch.dims.values() for name in names}
    if args.moe_n_group > 1 and "moe_n_group" not in mapped:
        reasons.append(f"group-limited routing ({args.moe_n_group} groups)")
    if args.moe_routed_scaling_factor != 1.0 and "moe_routed_scaling_factor" not in mapped:
        reasons.append(f"routed gates scaled by {args.moe_routed_scaling_factor}")
    if args.moe_first_dense_layers and not (arch.sparse_layers or arch.first_dense_key):
        reasons.append(f"{args.moe_first_dense_layers} dense first layer(s)")
    if args.moe_dense_layers and not arch.sparse_layers:
        reasons.append(f"dense layers {list(args.moe_dense_layers)}")
    if args.moe_score_func != arch.score_func:
        reasons.append(f"{args.moe_score_func} routing")
    if args.moe_expert_bias != arch.expert_bias:
        reasons.append("a routing bias" if args.moe_expert_bias else "no routing bias (set model.moe_expert_bias=true)")
    if args.moe_norm_topk and args.moe_top_k < 2:
        reasons.append("top-1 routing with renormalised gates (transformers' single gate is 1, paratrain's the "
                       "router probability)")
    if not args.moe_norm_topk and arch.norm_topk_key is None:
        reasons.append("top-k gates that are not renormalised")
    if not reasons:
        return None
    shared = ("with one sigmoid-gated shared expert" if arch.shared_expert_key else "with ungated shared experts, "
              "in groups, chosen with a per-expert bias" if arch.shared_count_key else "over routed experts only")
    return ", ".join(reasons) + f" ({arch.name} has {arch.score_func} top-k routing {shared})"


def export_mismatch(args: ModelArgs) -> str | None:
    """Why a model has no Hugging Face counterpart to be exported as, or None."""
    family = family_of(args)
    arch = _export_arch(args)
    if arch is None and not any(a.exported for a in family.hf_archs):
        mapped = ", ".join(name for name, f in FAMILIES.items() if any(a.exported for a in f.hf_archs))
        return f"model family '{family.name}' (paratrain maps the families {mapped} to Hugging Face configs)"
    if arch is None:
        kind = "a mixture of experts" if args.moe_experts else "dense blocks only"
        return f"{kind} in model family '{family.name}' (none of its Hugging Face architectures has that)"
    return _moe_mismatch(args, arch) if arch.moe else None


def hf_config_from_args(args: ModelArgs, vocab_size: int, dtype: str, bos_id: int | None, eos_id: int | None,
                        name: str = "model") -> dict:
    """config.json for a paratrain model, as its family's architecture (UserError naming what does not map).
    Written in transformers 4's keys (`rope_theta`, `rope_scaling`), which transformers 5, vLLM and llama.cpp's
    converter all read."""
    why = export_mismatch(args)
    if why:
        raise UserError(f"{name} cannot be exported as a Hugging Face model: it has {why}")
    arch = _export_arch(args)
    cfg = {
        "architectures": [arch.name],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
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
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": Precision(dtype).dtype_name,
        **arch.fixed,
        **arch.written,
    }
    if args.rope_scaling == "llama3":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                               "low_freq_factor": args.rope_low_freq_factor,
                               "high_freq_factor": args.rope_high_freq_factor,
                               "original_max_position_embeddings": args.rope_original_max_seq_len}
    if arch.moe:
        cfg.update({arch.experts_keys[0]: args.moe_experts, "num_experts_per_tok": args.moe_top_k,
                    arch.expert_hidden_key: args.expert_hidden, "router_aux_loss_coef": args.moe_aux_loss_coef})
        if arch.norm_topk_key:
            cfg[arch.norm_topk_key] = args.moe_norm_topk
        if arch.shared_expert_key:
            cfg[arch.shared_expert_key] = args.expert_hidden * args.moe_shared_experts
        if arch.shared_count_key:
            cfg[arch.shared_count_key] = args.moe_shared_experts
        if arch.first_dense_key:
            cfg[arch.first_dense_key] = args.moe_first_dense_layers
        if arch.sparse_layers:
            cfg.update(decoder_sparse_step=1, mlp_only_layers=[i for i in range(args.n_layers)
                                                               if not args.is_moe_layer(i)])
    cfg.update({key: getattr(args, names[0]) or None for key, names in arch.dims.items()})  # 0 written as null
    return cfg


def resume_hint(path: Path) -> str | None:
    """Why a Hugging Face folder given as a checkpoint to resume is not one, and what to use."""
    if is_hf_folder(path):
        return f"it is a Hugging Face model folder; start a run from it with --model.init_from=hf:{path}"
    return None
