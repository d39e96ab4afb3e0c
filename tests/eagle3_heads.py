"""Random EAGLE-3 heads in the exported format (config.json + model.safetensors), for the tests.

The layout is ModelOpt's `export_speculative_decoding` output for a llama head (see specdeploy.engine.eagle3).
Test code: the package ships none of it.
"""

from __future__ import annotations

import json
from pathlib import Path


def make_eagle3_head(
    path: str | Path,
    hidden_size: int,
    vocab_size: int,
    aux_layer_ids=(0, 1, 2),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    scale: float = 0.05,
    d2t=None,  # a [draft_vocab] int64 tensor; default: the first draft_vocab target ids (all offsets 0)
    with_norm: bool = True,
    top_level_ids: bool = False,
    dtype: str = "bfloat16",
) -> Path:
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    draft_vocab = draft_vocab_size or vocab_size
    head_size = hidden_size // num_heads
    h, inter, n_aux = hidden_size, intermediate_size, len(aux_layer_ids)
    g = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(torch_dtype)

    def norm():
        return (1.0 + 0.1 * torch.randn(h, generator=g)).to(torch_dtype)

    p = "layers.0."
    tensors = {
        "fc.weight": rand(h, n_aux * h),
        f"{p}self_attn.q_proj.weight": rand(num_heads * head_size, 2 * h),
        f"{p}self_attn.k_proj.weight": rand(num_kv_heads * head_size, 2 * h),
        f"{p}self_attn.v_proj.weight": rand(num_kv_heads * head_size, 2 * h),
        f"{p}self_attn.o_proj.weight": rand(h, num_heads * head_size),
        f"{p}mlp.gate_proj.weight": rand(inter, h),
        f"{p}mlp.up_proj.weight": rand(inter, h),
        f"{p}mlp.down_proj.weight": rand(h, inter),
        f"{p}input_layernorm.weight": norm(),
        f"{p}hidden_norm.weight": norm(),
        f"{p}post_attention_layernorm.weight": norm(),
        "lm_head.weight": rand(draft_vocab, h) * 20,
    }
    if with_norm:
        tensors["norm.weight"] = norm()
    if draft_vocab != vocab_size or d2t is not None:
        tensors["d2t"] = (d2t if d2t is not None else torch.zeros(draft_vocab, dtype=torch.int64)).to(torch.int64)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_size,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": None if top_level_ids else list(aux_layer_ids),
            "use_aux_hidden_state": True,
            "use_last_layernorm": with_norm,
        },
    }
    if top_level_ids:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
