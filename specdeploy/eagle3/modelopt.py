"""The EAGLE-3 head through NVIDIA ModelOpt (`modelopt.torch.speculative`): its vocabulary (`choose_draft_vocab`,
ModelOpt's d2t map), its config sized like the target (`eagle_config`), the target converted with a fresh head
(`build_model`), and the standard EAGLE-3 checkpoint out (`export_head`) and back in (`load_exported_head`).

ModelOpt 0.47 on CPU has traps (docs/eagle3-train.md); each workaround below says which.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from specdeploy.core.errors import ConfigError, ModelError
from specdeploy.recipe.config import EAGLE3_VOCAB_COUNTS, Eagle3TrainConfig, to_plain

# ---------------------------------------------------------------- draft vocabulary


def answer_counts(samples):
    """How often each target id is an answer token (>= loss_start) of `samples`: a Counter."""
    from collections import Counter

    answers = Counter()
    for s in samples:
        answers.update(s.input_ids[s.loss_start :])
    return answers


def choose_draft_vocab(samples, vocab_size: int, draft_vocab_size: int) -> list[int] | None:
    """The head's vocabulary: the `draft_vocab_size` target ids most frequent in the answers (ties: lower id),
    filled up from the prompts and then the lowest ids; ascending. None when it would be the full vocabulary.

    ModelOpt's convention (plugins/hf_eagle.py `pseudo_speculative_generate`: `draft_token += d2t[draft_token]`,
    and `_map_logits_to_draft_vocab`: target ids = arange + d2t): target_id = draft_id + d2t[draft_id]."""
    if draft_vocab_size >= vocab_size:
        return None
    from collections import Counter

    answers, prompts = answer_counts(samples), Counter()
    for s in samples:
        prompts.update(s.input_ids[: s.loss_start])
    chosen: list[int] = []
    seen: set[int] = set()
    for counter in (answers, prompts):
        for token, _ in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) == draft_vocab_size:
                break
            if token not in seen:
                chosen.append(token)
                seen.add(token)
    token = 0
    while len(chosen) < draft_vocab_size:
        if token not in seen:
            chosen.append(token)
            seen.add(token)
        token += 1
    return sorted(chosen)


def head_draft_ids(head_dir: Path) -> tuple[int, list[int] | None]:
    """An exported head's (vocab_size, the target id of each draft id), None for a head over the whole vocabulary."""
    from safetensors import safe_open

    config = json.loads((Path(head_dir) / "config.json").read_text())
    with safe_open(str(Path(head_dir) / "model.safetensors"), "pt") as f:
        if "d2t" not in f.keys():
            return int(config["vocab_size"]), None
        d2t = f.get_tensor("d2t").long()
    import torch

    return int(config["vocab_size"]), (torch.arange(len(d2t)) + d2t).tolist()


def write_vocab_counts(head_dir: Path, samples, source: str) -> tuple[Path, dict]:
    """Write EAGLE3_VOCAB_COUNTS into an exported head's folder: how often each of its draft ids is an answer token of
    `samples` (the data of folder `source`), the counts draft.serve_vocab_size ranks by; through a temporary file, so
    an earlier file survives a failure. Returns the file and what it holds."""
    vocab_size, draft_ids = head_draft_ids(head_dir)
    answers = answer_counts(samples)
    counts = [answers.get(t, 0) for t in (range(vocab_size) if draft_ids is None else draft_ids)]
    path = Path(head_dir) / EAGLE3_VOCAB_COUNTS
    tmp = path.with_name(path.name + ".tmp")
    body = {
        "what": (
            "answer tokens per draft id of the training samples of `source`, a draft data folder "
            "(draft.serve_vocab_size keeps the most counted)"
        ),
        "source": source,
        "answer_tokens": sum(answers.values()),
        "counted": sum(counts),
        "counts": counts,
    }
    try:
        tmp.write_text(json.dumps(body) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write leaves no partial file beside the head
    return path, body


def d2t_of(draft_ids: list[int]):
    import torch

    ids = torch.tensor(draft_ids, dtype=torch.int64)
    return ids - torch.arange(len(draft_ids), dtype=torch.int64)  # [draft_vocab]


# ---------------------------------------------------------------- the model


def aux_layer_ids(target_config: dict, t: Eagle3TrainConfig) -> list[int]:
    """Target layers whose outputs feed the head: draft.train.aux_layers, or ModelOpt's default."""
    from modelopt.torch.speculative.plugins.hf_eagle import default_eagle_aux_layer_ids

    layers = target_config["num_hidden_layers"]
    ids = list(t.aux_layers) or default_eagle_aux_layer_ids(layers)
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise ConfigError(
            f"draft.train.aux_layers: layer {bad[0]} does not exist (the target has {layers} layers, 0..{layers - 1})",
            "name layers of the target, or leave aux_layers empty for ModelOpt's default",
        )
    return sorted(set(ids))


def eagle_config(target_config: dict, t: Eagle3TrainConfig, draft_vocab_size: int, aux_ids: list[int]) -> dict:
    """ModelOpt's EAGLE3_DEFAULT_CFG with the head sized like the target and the CPU traps avoided."""
    import modelopt.torch.speculative as mtsp

    cfg = copy.deepcopy(mtsp.config.EAGLE3_DEFAULT_CFG)["config"]
    heads = target_config["num_attention_heads"]
    rope_theta = _rope_theta(target_config)
    cfg["eagle_architecture_config"].update(
        intermediate_size=target_config["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=target_config.get("num_key_value_heads") or heads,
        head_dim=target_config.get("head_dim") or target_config["hidden_size"] // heads,
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-5),
        hidden_act=target_config.get("hidden_act", "silu"),
        # the target's own RoPE base (the default's 10000 is Llama-2's), no scaling
        rope_theta=rope_theta,
        rope_scaling={"rope_type": "default", "rope_theta": rope_theta},
        torch_dtype="float32",
        draft_vocab_size=draft_vocab_size,
        eagle_aux_hidden_state_layer_ids=aux_ids,
    )
    cfg["eagle_ttt_steps"] = t.ttt_steps
    # trap 2: torch.compile(max-autotune) costs minutes per shape on CPU and buys nothing here
    cfg["eagle_use_torch_compile"] = False
    # the exporter would write YaRN scaling (factor 32) into config.json although the head trained without it
    # (modelopt/torch/export/plugins/hf_spec_export.py `_export_config`, and speculative/config.py
    # `eagle_export_rope_scaling`): the head is exported with the RoPE it trained with.
    cfg["eagle_export_rope_scaling"] = {}
    return cfg


def _rope_theta(target_config: dict) -> float:
    for source in (target_config, target_config.get("rope_parameters") or {}, target_config.get("rope_scaling") or {}):
        if source.get("rope_theta") is not None:
            return float(source["rope_theta"])
    return 10000.0


def build_model(
    target_dir: Path,
    t: Eagle3TrainConfig,
    draft_ids: list[int] | None,
    aux_ids: list[int],
    device: str = "cpu",
    offline: bool = False,
):
    """The target (frozen, fp32) converted to ModelOpt's EAGLE-3 model with a fresh head (seeded).

    `offline`: ModelOpt's offline mode (`eagle_offline`): the target's decoder layers are dropped and each forward
    takes the target's outputs as `base_model_outputs` (draft.train.features: engine, specdeploy.eagle3.features);
    the embeddings, final norm and LM head stay."""
    import modelopt.torch.speculative as mtsp
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    target_config = model.config.to_dict()
    vocab = target_config["vocab_size"]
    draft_vocab_size = len(draft_ids) if draft_ids is not None else vocab
    last_layer = model.model.layers[-1]  # kept for init_from_target: offline mode drops the layers
    torch.manual_seed(t.seed)  # the head's initial weights
    cfg = eagle_config(target_config, t, draft_vocab_size, aux_ids)
    cfg["eagle_offline"] = offline
    mtsp.convert(model, [("eagle", cfg)])
    head = model.eagle_module
    if draft_ids is not None:
        with torch.no_grad():
            head.d2t.copy_(d2t_of(draft_ids))
    # trap 1: ModelOpt builds the head's rotary embedding with a `device=` keyword (plugins/modeling_eagle.py
    # `_maybe_init_rope`) that transformers 5.23's LlamaRotaryEmbedding(config) does not take; it only builds one
    # when the head has none, so the head gets it here (inv_freq is not a persistent buffer: nothing is exported).
    head.rotary_emb = LlamaRotaryEmbedding(config=head.config)
    # trap 3: the head keeps ModelOpt's default sdpa attention (flex attention has no CPU backward).
    assert head.config._attn_implementation == "sdpa", head.config._attn_implementation
    # trap 5: ModelOpt 0.47 feeds the features through the decoder layer's input_layernorm before its attention
    # pre-hook applies hidden_norm (plugins/modeling_eagle.py `_eagle3_attention_forward_pre_hook`: self_attn gets
    # `input_layernorm(hidden_states)` from LlamaDecoderLayer), while the runtimes that serve the head normalise the
    # features with hidden_norm only (TensorRT-LLM Eagle3DecoderLayer, vLLM llama_eagle3, llama.cpp eagle3, and
    # specdeploy/engine/eagle3.py). With input_layernorm's weight held at ones the extra RMSNorm is the identity on
    # an already normalised vector, so what is trained is what is served; the weight only scales the embeddings'
    # half of q/k/v's input, which q/k/v learn anyway.
    head.layers[0].input_layernorm.weight.requires_grad_(False)
    fused_ttt_attention(model)
    if t.init_from_target:
        init_head_from_target(model, draft_ids, last_layer)
    model.to(device)
    return model


def fused_ttt_attention(model) -> None:
    """trap 6: let the training-time test's attention take torch's fused CPU kernel.

    In training ModelOpt 0.47 runs every TTT step of the head inside `enable_cp_ttt_patch(eagle_cp_size)`
    (plugins/hf_eagle.py:196 `_enable_cp_ttt`, speculative/utils.py:570), which limits SDPA to
    [CUDNN_ATTENTION, MATH] even without context parallelism; on a CPU that leaves the unfused math path, which
    materialises every [batch, heads, q, (1 + step) * q] score matrix, its softmax and their gradients. torch's CPU
    flash kernel takes the same dense additive TTT mask (forward and backward), so with one context-parallel rank
    the steps run under [FLASH_ATTENTION, CUDNN_ATTENTION, MATH] instead: the same attention, other rounding
    (tests/test_draft_train.py bounds the loss and gradients). The module flag the patch also sets is read by nothing
    else in ModelOpt 0.47."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if getattr(model, "eagle_cp_size", 1) > 1:
        return

    def enable_ttt():
        if model.training and not model.eagle_mix_hidden_states:
            return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH])
        return contextlib.nullcontext()

    model._enable_cp_ttt = enable_ttt


def draft_target_ids(model):
    """The target id of each draft id of a converted model's head (target id = draft id + d2t); every id in order
    where the head drafts over the whole vocabulary (no d2t)."""
    import torch

    d2t = getattr(model.eagle_module, "d2t", None)
    return torch.arange(model.eagle_config.vocab_size) if d2t is None else torch.arange(len(d2t)) + d2t.cpu()


def accept_draft_space_logits(model) -> None:
    """Let ModelOpt take base_model_logits already over the draft vocabulary (draft_features.TopKFeatures).

    ModelOpt maps the target's logits into the draft vocabulary itself (plugins/hf_eagle.py `_prepare_eagle_inputs`
    calls `_map_logits_to_draft_vocab(full_logits)` = `full_logits[:, :, arange + d2t]` whenever draft_vocab_size !=
    vocab_size); logits whose last dimension is already the draft vocabulary's pass through unchanged. Logits over
    the whole vocabulary (the held-out passes) are still mapped by ModelOpt's own method."""
    original = model._map_logits_to_draft_vocab
    draft_vocab_size = model.eagle_config.draft_vocab_size

    def mapped(logits):
        return logits if logits.shape[-1] == draft_vocab_size else original(logits)

    model._map_logits_to_draft_vocab = mapped


def acceptance_loss(kind: str, target_probs, eagle_logits, loss_mask):
    """draft.train.loss `lk` or `tv` for one training-time-test step, over the positions loss_mask keeps.

    alpha = sum_x min(p(x), q(x)) is the probability that a token drafted from q is accepted against p (speculative
    sampling's acceptance, 1 - TV(p, q)). lk: the mean of -log alpha, the LK loss of arXiv 2602.23881 ("LK Losses:
    Direct Acceptance Rate Optimization for Speculative Decoding", Nebius; section 3, the negative log-acceptance form,
    whose gradient is TV's scaled by 1 / alpha, so it does not vanish where the head is far off); tv: the mean of
    1 - alpha. target_probs [B, S', V] (ModelOpt's base_output_softmax_logits: the target's distribution over the
    draft vocabulary), eagle_logits [B, S, V] with S <= S', loss_mask [B, S'']."""
    import torch

    width = eagle_logits.shape[1]
    mask = loss_mask[:, :width].float()
    q = torch.softmax(eagle_logits.float(), dim=2)
    alpha = torch.minimum(target_probs[:, :width].float(), q).sum(dim=2)  # [B, S]
    per_position = -torch.log(alpha.clamp_min(1e-6)) if kind == "lk" else 1.0 - alpha
    return (per_position * mask).sum() / (mask.sum() + 1e-5)  # ModelOpt's normalisation (hf_eagle.py `_eagle_loss`)


def use_loss(model, kind: str) -> None:
    """Train a converted model's head on draft.train.loss `kind`: `kl` leaves ModelOpt's own `_eagle_loss` (0.47,
    plugins/hf_eagle.py:852-872: soft cross-entropy against the target's softmax, and the position accuracy); `lk` and
    `tv` replace it by `acceptance_loss` and the same accuracy. ModelOpt calls `self._eagle_loss(...)` once
    per training-time-test step (hf_eagle.py:812-818), so an attribute of the instance replaces it (as
    `accept_draft_space_logits` replaces `_map_logits_to_draft_vocab`)."""
    if kind == "kl":
        return

    def loss(base_output_softmax_logits, base_output_predict_tok, eagle_logits, loss_mask):
        width = eagle_logits.shape[1]
        valid = loss_mask[:, :width].bool()
        hits = (base_output_predict_tok[:, :width] == eagle_logits.detach().argmax(dim=-1)) & valid
        accuracy = hits.sum().float() / valid.sum().clamp_min(1).float()  # as ModelOpt's: top-1 equals the target's
        return acceptance_loss(kind, base_output_softmax_logits, eagle_logits, loss_mask), accuracy

    model._eagle_loss = loss


def init_head_from_target(model, draft_ids: list[int] | None, src) -> None:
    """Start the head's decoder layer from the target's last layer `src` and its LM head from the target's rows.

    ModelOpt has no such option (its head starts random). The head's q/k/v read [embeddings, hidden] (2x
    hidden): the hidden half takes the target's weights, the embedding half stays as initialised."""
    import torch

    dst = model.eagle_module.layers[0]
    h = model.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(dst.self_attn, name).weight[:, h:].copy_(getattr(src.self_attn, name).weight)
        dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        model.eagle_module.norm.weight.copy_(model.model.norm.weight)
        if hasattr(model.eagle_module, "lm_head"):
            rows = model.lm_head.weight if draft_ids is None else model.lm_head.weight[torch.tensor(draft_ids)]
            model.eagle_module.lm_head.weight.copy_(rows)


def head_parameters(model) -> list:
    return [p for p in model.eagle_module.parameters() if p.requires_grad]


# ---------------------------------------------------------------- export


def cast_weights(path: Path, dtype: str) -> None:
    """Rewrite an exported head's weights in `dtype` (draft.train.export_dtype); d2t stays integer. The head trains
    in fp32; bfloat16 halves the file (the CPU engine and the GPU runtimes compute the head in bf16 anyway)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    cast = {
        k: v if k == "d2t" or not v.is_floating_point() else v.to(getattr(torch, dtype)) for k, v in weights.items()
    }
    tmp = path.with_suffix(".tmp")
    save_file(cast, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def export_head(model, out_dir: Path, aux_ids: list[int], dtype: str = "float32") -> dict:
    """ModelOpt's exporter (export_speculative_decoding), then config.json stating what was trained.

    The exporter writes the state dict as it is (fp32 here) while config.json takes `torch_dtype` from the
    architecture config; the RoPE is the one trained (eagle_export_rope_scaling={}). llama.cpp's converter reads a
    top-level `eagle_aux_hidden_state_layer_ids` (conversion/llama.py) as the layers whose *inputs* it captures
    (src/llama-context.cpp `extract_layer_inputs`, common/speculative.cpp `llama_set_embeddings_layer_inp`),
    while ModelOpt's ids are layers whose *outputs* feed the head (plugins/hf_eagle.py forward hook): the top-level
    copy is ModelOpt's ids + 1 (its default [2, L//2, L-3] is ModelOpt's [1, L//2-1, L-4] + 1)."""
    from modelopt.torch.export import export_speculative_decoding
    from safetensors import safe_open

    out_dir = Path(out_dir)
    export_speculative_decoding(model, export_dir=out_dir)
    if dtype != "float32":
        cast_weights(out_dir / "model.safetensors", dtype)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()).lower() for k in f.keys() if k != "d2t"}
    names = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
    dtype = names.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"
    config["torch_dtype"] = dtype
    config["dtype"] = dtype
    head_config = model.eagle_module.config
    config["rope_theta"] = _rope_theta(to_plain(head_config.to_dict()))
    config["rope_scaling"] = None
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in aux_ids]
    config["target_hidden_size"] = model.config.hidden_size
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return config


def load_exported_head(model, head_dir: Path) -> None:
    """Load an exported head's weights into a converted model (the inverse of export_head, for checks)."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(head_dir) / "model.safetensors"))
    own = model.eagle_module.state_dict()
    if "lm_head.weight" not in own:
        weights.pop("lm_head.weight")  # the exporter adds the target's when the head shares it
    missing, unexpected = model.eagle_module.load_state_dict(
        {k: v.to(own[k].dtype) for k, v in weights.items()}, strict=False
    )
    if missing or unexpected:
        raise ModelError(
            f"{head_dir}: the exported head does not match this model (missing {missing}, unexpected {unexpected})",
            "export it again with specdeploy draft train --force",
        )
