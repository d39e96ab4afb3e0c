"""The quantize stage: Hugging Face checkpoints -> TensorRT-LLM checkpoints, with NVIDIA ModelOpt, on CPU.

Read top to bottom:
  1. the format tables (TensorRT-LLM's `--qformat` / `--kv_cache_dtype` words -> ModelOpt configs),
  2. input checks (architecture, format combinations TensorRT-LLM rejects, shapes, disk space),
  3. calibration text (built-in set or the user's .txt/.jsonl), packed into fixed-length samples,
  4. `quantize_model`: load -> `mtq.quantize` (calibrate) -> quality report -> `export_tensorrt_llm_checkpoint`,
  5. the quality report (perplexity, top-1 agreement, KL) of the fake-quantized model against its source,
  6. `quantize_recipe`: both roles of a recipe, atomically, with manifests and "up to date" reuse.

The same steps TensorRT-LLM's `examples/quantization/quantize.py` takes (quantize_by_modelopt.py), minus
the GPU: `full_prec` exports unquantized weights, every other format calibrates with ModelOpt first.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from specdeploy import calibration
from specdeploy.config import AWQ_BLOCK_SIZES, KV_CACHE_DTYPES, QFORMATS, QuantConfig, Recipe, to_plain
from specdeploy.errors import ConfigError, ModelError, QuantizeError

STAGE = "quantize"
TOOL_DISTRIBUTIONS = ("nvidia-modelopt", "torch", "transformers")

# ---------------------------------------------------------------- formats

# --qformat -> name of the ModelOpt config (None: export without quantizing, as TensorRT-LLM does).
MODELOPT_CFG = {
    "full_prec": None,
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",
    "int4_awq": "INT4_AWQ_CFG",
}
# What each format writes into config.json (quantization.quant_algo), as TensorRT-LLM's QuantAlgo names it.
QUANT_ALGO = {
    "full_prec": None,
    "fp8": "FP8",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int8_wo": "W8A16",
    "int4_awq": "W4A16_AWQ",
}
KV_CACHE_QUANT_ALGO = {None: None, "fp8": "FP8", "int8": "INT8"}
# KV cache quantizers: ModelOpt's FP8_KV_CFG pattern; INT8 uses the same quantizers with 8 integer
# bits (TensorRT-LLM's KV_CACHE_CFG in quantize_by_modelopt.py: num_bits 8, axis None).
KV_NUM_BITS = {"fp8": (4, 3), "int8": 8}
# Bytes per stored weight element, for the disk-space estimate (unquantized tensors are 16-bit).
WEIGHT_BYTES = {"full_prec": 2.0, "fp8": 1.0, "int8_sq": 1.0, "int8_wo": 1.0, "int4_awq": 0.5}
# TensorRT-LLM's quantize.py calibrates AWQ with at most 32 samples ("AWQ calibration could take longer").
AWQ_MAX_CALIB_SIZE = 32
# Formats whose scales come from the weights alone (ModelOpt "max" calibration of weight quantizers only).
WEIGHT_ONLY_MAX_CALIBRATION = ("int8_wo",)
# Weight-only GEMM kernels need the per-rank input dimension divisible by 64 (TensorRT-LLM issue #729).
WEIGHT_ONLY_K_MULTIPLE = 64

# Hugging Face `model_type` -> ModelOpt / TensorRT-LLM decoder type. Only decoder families whose
# TensorRT-LLM checkpoint specdeploy's engines understand (Llama-style: RMSNorm, RoPE, gated SiLU MLP).
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen"}

# Combinations that TensorRT-LLM refuses when building an engine with paged context FMHA, which the
# draft/target flow needs for KV-cache block reuse (tensorrt_llm/builder.py `build`, and the same checks
# in the C++ attention op). Messages quoted from TensorRT-LLM.
PAGED_CONTEXT_FMHA_REJECTS = {
    "int8": "Paged Context FMHA doesn't work with int8 kv cache currently.",
    "fp8": "FP8 Paged Context FMHA only works with fp8 quantization workflow currently.",
}

BUILTIN = "builtin"
CALIB_FILE = "calibration.jsonl"
HELDOUT_FILE = "heldout.jsonl"


def modelopt_config(quant: QuantConfig) -> dict | None:
    """The ModelOpt quantization config for a QuantConfig (None: nothing to calibrate)."""
    import modelopt.torch.quantization as mtq

    name = MODELOPT_CFG[quant.qformat]
    if name is None and quant.kv_cache_dtype is None:
        return None
    if name is None:  # KV cache only, like TensorRT-LLM's EMPTY_CFG + KV cache config
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, name))
    if quant.qformat == "int4_awq":
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in entry.get("cfg", {}):
                entry["cfg"]["block_sizes"][-1] = quant.awq_block_size
    if quant.kv_cache_dtype is not None:
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        for entry in kv:
            entry["cfg"]["num_bits"] = KV_NUM_BITS[quant.kv_cache_dtype]
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + kv
    return cfg


# ---------------------------------------------------------------- input checks


def check_quant_config(quant: QuantConfig, paged_context_fmha: bool = True) -> None:
    """Refuse formats and combinations TensorRT-LLM cannot build; each error names the fix."""
    if quant.qformat not in MODELOPT_CFG:
        raise ConfigError(f"unknown qformat {quant.qformat!r}", f"valid choices: {', '.join(QFORMATS)}")
    if quant.kv_cache_dtype not in KV_CACHE_DTYPES:
        shown = ", ".join("null" if k is None else k for k in KV_CACHE_DTYPES)
        raise ConfigError(f"unknown kv_cache_dtype {quant.kv_cache_dtype!r}", f"valid choices: {shown}")
    if quant.qformat == "int4_awq" and quant.awq_block_size not in AWQ_BLOCK_SIZES:
        raise ConfigError(
            f"awq_block_size {quant.awq_block_size} is not supported", f"use one of {', '.join(map(str, AWQ_BLOCK_SIZES))}"
        )
    if paged_context_fmha and quant.kv_cache_dtype == "int8":
        raise ConfigError(
            f"qformat {quant.qformat!r} with kv_cache_dtype 'int8': TensorRT-LLM refuses it: "
            f"\"{PAGED_CONTEXT_FMHA_REJECTS['int8']}\" (the draft/target engines need paged context FMHA)",
            "set kv_cache_dtype: null, or kv_cache_dtype: fp8 together with qformat: fp8",
        )
    if paged_context_fmha and quant.kv_cache_dtype == "fp8" and quant.qformat != "fp8":
        raise ConfigError(
            f"qformat {quant.qformat!r} with kv_cache_dtype 'fp8': TensorRT-LLM refuses it: "
            f"\"{PAGED_CONTEXT_FMHA_REJECTS['fp8']}\" (the draft/target engines need paged context FMHA)",
            "use kv_cache_dtype: fp8 only with qformat: fp8, or set kv_cache_dtype: null",
        )


def read_hf_config(source_dir: Path) -> dict:
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        raise ModelError(f"model directory {source_dir} does not exist", "pass a Hugging Face model folder")
    path = source_dir / "config.json"
    if not path.is_file():
        raise ModelError(f"model directory {source_dir} has no config.json", "point at a Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}", "re-download or re-save the model") from exc


def weight_files(source_dir: Path) -> list[Path]:
    return sorted(Path(source_dir).glob("*.safetensors")) + sorted(Path(source_dir).glob("pytorch_model*.bin"))


def check_model(source_dir: Path, quant: QuantConfig, tp_size: int, pp_size: int) -> dict:
    """Check the source folder and its shapes against the format and parallelism; return its HF config."""
    hf = read_hf_config(source_dir)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise QuantizeError(
            f"model type {model_type!r} ({', '.join(hf.get('architectures') or ['?'])}) in {source_dir} "
            "is not supported by the quantize stage",
            f"use a model of type {', '.join(SUPPORTED_MODEL_TYPES)} (Llama, Mistral, Qwen2 families)",
        )
    if not weight_files(source_dir):  # same words as specdeploy.models.resolve
        raise ModelError(
            f"model directory {source_dir} has no weights (*.safetensors or pytorch_model*.bin)",
            "download or save the model's weights into that folder (e.g. model.save_pretrained(dir))",
        )
    if tp_size < 1 or pp_size < 1:
        raise ConfigError(f"tp_size {tp_size} and pp_size {pp_size} must be >= 1")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % tp_size or (kv_heads % tp_size and tp_size % kv_heads):
        raise ConfigError(
            f"tp_size {tp_size} does not divide the model's {heads} attention / {kv_heads} KV heads",
            "choose a tp_size that divides the number of attention heads",
        )
    if hf["num_hidden_layers"] < pp_size:
        raise ConfigError(f"pp_size {pp_size} exceeds the model's {hf['num_hidden_layers']} layers")
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    # Input dimension (K) of each linear on one tensor-parallel rank: column-parallel layers (qkv, fc,
    # gate) see the full hidden size; row-parallel ones (dense, proj) a 1/tp slice.
    k_dims = {"qkv/fc/gate": hidden, "dense": heads * head_dim // tp_size, "proj": inter // tp_size}
    multiple = {"int4_awq": quant.awq_block_size, "int8_wo": WEIGHT_ONLY_K_MULTIPLE}.get(quant.qformat)
    if multiple:
        bad = {name: k for name, k in k_dims.items() if k % multiple}
        if bad:
            what = f"awq_block_size {multiple}" if quant.qformat == "int4_awq" else f"{multiple} (weight-only kernels)"
            fix = "set awq_block_size: 64" if quant.qformat == "int4_awq" and multiple == 128 else "use another qformat"
            raise ConfigError(
                f"qformat {quant.qformat!r}: input dimensions per rank {bad} are not multiples of {what}",
                f"{fix}, or a smaller tp_size",
            )
    return hf


def estimate_output_bytes(source_dir: Path, quant: QuantConfig) -> int:
    """Upper estimate of the checkpoint size: every weight at the format's width, 16-bit at most, plus 5%."""
    from safetensors import safe_open

    numel = 0
    for path in weight_files(source_dir):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    numel += math.prod(fh.get_slice(name).get_shape())
        else:
            numel += path.stat().st_size // 4  # a .bin of fp32 weights: 4 bytes per element at most
    return int(numel * max(WEIGHT_BYTES[quant.qformat], 2.0) * 1.05) + (1 << 20)


def check_disk_space(out_dir: Path, needed: int) -> None:
    probe = Path(out_dir).absolute()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise QuantizeError(
            f"not enough disk space for the checkpoint in {out_dir}: about {needed / 2**20:.0f} MiB needed, "
            f"{free / 2**20:.0f} MiB free",
            "free some space on that disk or pass --root on a bigger one",
        )


# ---------------------------------------------------------------- calibration text


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("specdeploy") / "data" / "calib" / name))


def read_passages(path: str | Path) -> list[str]:
    """Passages of a .jsonl file ({"text": ...} per line, or a JSON string) or a .txt file (blank-line separated)."""
    path = Path(path)
    hint = "pass a UTF-8 .txt file (passages separated by blank lines) or a .jsonl file with a \"text\" field per line"
    if not path.is_file():
        raise ConfigError(f"calibration file {path} not found", hint)
    if path.suffix not in (".txt", ".jsonl"):
        raise ConfigError(f"calibration file {path} must end in .txt or .jsonl", hint)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"calibration file {path} is unreadable: {exc}", hint) from exc
    if path.suffix == ".txt":
        blocks = [b.strip() for b in text.replace("\r\n", "\n").split("\n\n")]
        passages = [b for b in blocks if b]
    else:
        passages = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"calibration file {path} line {lineno} is not JSON: {exc}", hint) from exc
            value = item.get("text") if isinstance(item, dict) else item
            if not isinstance(value, str):
                raise ConfigError(f"calibration file {path} line {lineno} has no string \"text\" field", hint)
            if value.strip():
                passages.append(value)
    if not passages:
        raise ConfigError(f"calibration file {path} is empty (no passages)", hint)
    return passages


def calibration_passages(calib_dataset: str) -> list[str]:
    return read_passages(builtin_path(CALIB_FILE) if calib_dataset == BUILTIN else calib_dataset)


def heldout_passages() -> list[str]:
    return read_passages(builtin_path(HELDOUT_FILE))


def pack_samples(token_lists: list[list[int]], num_samples: int, seq_len: int, seed: int, sep_id: int | None):
    """Cut a seeded shuffle of the passages, joined end to end, into `num_samples` rows of `seq_len` tokens.

    Packing (as for pile/c4 calibration) gives every sample full length; when the text runs out, it is
    reshuffled and repeated. Returns (LongTensor[num_samples, seq_len], number of passes over the text).
    """
    import torch

    rng = random.Random(seed)
    needed = num_samples * seq_len
    stream: list[int] = []
    passes = 0
    while len(stream) < needed:
        order = list(range(len(token_lists)))
        rng.shuffle(order)
        for i in order:
            stream.extend(token_lists[i])
            if sep_id is not None:
                stream.append(sep_id)
        passes += 1
    return torch.tensor(stream[:needed], dtype=torch.long).view(num_samples, seq_len), passes


def tokenize(tokenizer, passages: list[str]) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in passages]


def calibration_samples(tokenizer, quant: QuantConfig, echo=print):
    passages = calibration_passages(quant.calib_dataset)
    token_lists = [t for t in tokenize(tokenizer, passages) if t]
    if not token_lists:
        raise ConfigError(f"calibration set {quant.calib_dataset!r} has no tokens", "use a file with text in it")
    num = quant.calib_size
    if quant.qformat == "int4_awq" and num > AWQ_MAX_CALIB_SIZE:
        echo(f"  AWQ: calib_size {num} -> {AWQ_MAX_CALIB_SIZE} (as TensorRT-LLM's quantize.py does)")
        num = AWQ_MAX_CALIB_SIZE
    samples, passes = pack_samples(token_lists, num, quant.calib_max_seq_length, quant.seed, tokenizer.eos_token_id)
    if passes > 1:
        echo(f"  calibration text used {passes} times to fill {num} x {quant.calib_max_seq_length} tokens")
    if quant.qformat in WEIGHT_ONLY_MAX_CALIBRATION and quant.kv_cache_dtype is None:
        # Max calibration of weight quantizers reads only the weights: one forward pass gives the same
        # scales as calib_size passes (TensorRT-LLM does not calibrate int8_wo at all).
        samples = samples[:1]
    return samples


# ---------------------------------------------------------------- quality report


@dataclass(frozen=True)
class QualityReport:
    """How far the quantized model (ModelOpt's fake-quantized simulation in torch) is from its source."""

    qformat: str
    kv_cache_dtype: str | None
    num_sequences: int
    num_tokens: int  # predicted positions
    source_perplexity: float
    quantized_perplexity: float
    top1_agreement: float  # fraction of positions where both models pick the same next token
    mean_kl: float  # mean over positions of KL(source || quantized), in nats

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self, title: str = "") -> str:
        label = self.qformat + (f" + {self.kv_cache_dtype} KV" if self.kv_cache_dtype else "")
        rows = [
            ("perplexity (source)", f"{self.source_perplexity:.3f}"),
            (f"perplexity ({label})", f"{self.quantized_perplexity:.3f}"),
            ("top-1 agreement", f"{100 * self.top1_agreement:.2f} %"),
            ("mean KL(source||quant)", f"{self.mean_kl:.5f} nats"),
            ("held-out text", f"{self.num_sequences} passages, {self.num_tokens} tokens"),
        ]
        width = max(len(r[0]) for r in rows)
        head = [f"quality{' of ' + title if title else ''} vs unquantized source:"]
        return "\n".join(head + [f"  {name:<{width}}  {value}" for name, value in rows])


def evaluate_quality(source_model, quant_model, token_lists, quant: QuantConfig, progress=True, num_passages=None) -> QualityReport:
    """Perplexity of both models, top-1 agreement and mean KL on held-out token rows (one forward each)."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    nll_source = nll_quant = kl_sum = 0.0
    agree = count = 0
    with torch.inference_mode():
        for ids in tqdm(token_lists, desc="quality", disable=not progress, leave=False):
            input_ids = torch.tensor([ids], dtype=torch.long)  # [1, T]
            targets = input_ids[0, 1:]  # [T-1]
            logp_source = F.log_softmax(source_model(input_ids).logits[0, :-1].float(), dim=-1)  # [T-1, vocab]
            if quant_model is source_model:
                logp_quant = logp_source
            else:
                logp_quant = F.log_softmax(quant_model(input_ids).logits[0, :-1].float(), dim=-1)
            nll_source -= logp_source.gather(1, targets[:, None]).sum().item()
            nll_quant -= logp_quant.gather(1, targets[:, None]).sum().item()
            kl_sum += (logp_source.exp() * (logp_source - logp_quant)).sum().item()
            agree += (logp_source.argmax(-1) == logp_quant.argmax(-1)).sum().item()
            count += targets.numel()
    return QualityReport(
        qformat=quant.qformat,
        kv_cache_dtype=quant.kv_cache_dtype,
        num_sequences=num_passages or len(token_lists),
        num_tokens=count,
        source_perplexity=math.exp(nll_source / count),
        quantized_perplexity=math.exp(nll_quant / count),
        top1_agreement=agree / count,
        mean_kl=max(kl_sum / count, 0.0),
    )


def heldout_rows(tokenizer, row_len: int) -> tuple[list[list[int]], int]:
    """The held-out passages, each as <bos> text <eos>, joined in file order and cut into rows of `row_len`.

    Rows instead of one forward per passage: fake-quantized layers re-quantize their weights on every
    forward, so a few long forwards cost far less than many short ones. Returns (rows, number of passages).
    """
    passages = heldout_passages()
    stream: list[int] = []
    for ids in tokenize(tokenizer, passages):
        stream += ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids
        stream += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rows = [stream[i : i + row_len] for i in range(0, len(stream), row_len)]
    return [r for r in rows if len(r) >= 2], len(passages)


# ---------------------------------------------------------------- one model


def export_dtype(engine_dtype: str) -> str:
    """Checkpoint dtype for unquantized tensors: TensorRT-LLM checkpoints are float16 or bfloat16."""
    return engine_dtype if engine_dtype in ("float16", "bfloat16") else "bfloat16"


@contextlib.contextmanager
def _quiet():
    """Silence ModelOpt's prints and its known-harmless warnings (no tensorrt_llm installed, untested transformers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tensorrt_llm.*")
        warnings.filterwarnings("ignore", message=".*not tested with current version of modelopt.*")
        warnings.filterwarnings("ignore", message=".*Large KV activation.*")
        warnings.filterwarnings("ignore", message=".*lm_head quantization may lead.*")  # lm_head stays unquantized
        warnings.filterwarnings("ignore", message=".*is not calibrated, skip smoothing.*")
        with contextlib.redirect_stdout(io.StringIO()):
            yield


@contextlib.contextmanager
def _hf_progress(enabled: bool):
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()


def quantize_model(
    source_dir: str | Path,
    quant: QuantConfig,
    out_dir: str | Path,
    tp_size: int = 1,
    pp_size: int = 1,
    progress: bool = True,
    dtype: str = "bfloat16",
    paged_context_fmha: bool = True,
    echo=print,
    checkpoint_format: str = "trtllm",
) -> QualityReport:
    """Quantize the Hugging Face model in `source_dir` with ModelOpt and write a TensorRT-LLM checkpoint.

    `out_dir` receives `config.json` + `rank{N}.safetensors` (N < tp_size * pp_size), as written by
    `modelopt.torch.export.export_tensorrt_llm_checkpoint`. Calibration is seeded (`quant.seed`) and
    deterministic. Returns the quality report of the quantized model against the source on held-out text.
    `paged_context_fmha=False` lifts the KV-cache combination checks (only for engines built without it).
    `checkpoint_format="hf"` writes ModelOpt's Hugging Face export instead (`export_hf_checkpoint`:
    safetensors + `hf_quant_config.json` + tokenizer), the format the TensorRT-LLM LLM API loads; the
    LLM API shards it itself, so it is written unsplit.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    check_quant_config(quant, paged_context_fmha)
    hf = check_model(source_dir, quant, tp_size, pp_size)
    check_disk_space(out_dir, estimate_output_bytes(source_dir, quant))
    if quant.calib_dataset != BUILTIN:
        read_passages(quant.calib_dataset)  # fail before loading the model

    with _quiet():
        import modelopt.torch.quantization as mtq
        import torch
        from modelopt.torch.export import export_tensorrt_llm_checkpoint
        from tqdm.auto import tqdm
        from transformers import AutoModelForCausalLM, AutoTokenizer

    random.seed(quant.seed)
    torch.manual_seed(quant.seed)
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source_dir))
        # A GPU calibrates in bf16 across the GPUs (device_map auto); the CPU in fp32 (calibration.plan_calibration).
        on_gpu = torch.cuda.is_available()
        load = {"dtype": torch.bfloat16, "device_map": "auto"} if on_gpu else {"dtype": torch.float32}
        with _hf_progress(progress):
            model = AutoModelForCausalLM.from_pretrained(str(source_dir), **load).eval()
        echo(f"  calibrating on {'the GPU(s) in bf16' if on_gpu else 'the CPU in fp32'}")
    except (OSError, ValueError) as exc:
        raise QuantizeError(f"cannot load the model in {source_dir}: {exc}", "check the folder is a complete HF model") from exc

    cfg = modelopt_config(quant)
    source_model = model
    t1 = time.perf_counter()
    if cfg is not None:
        samples = calibration_samples(tokenizer, quant, echo)  # [calib_size, calib_max_seq_length]
        if on_gpu:  # the unquantized reference stays in RAM, not in GPU memory
            with _hf_progress(False):
                source_model = AutoModelForCausalLM.from_pretrained(str(source_dir), dtype=torch.bfloat16).eval()
        else:
            source_model = copy.deepcopy(model)  # the reference for the quality report (twice the model's memory)

        def forward_loop(m):  # ModelOpt calls this once per calibration pass (AWQ: several)
            with torch.no_grad():
                for row in tqdm(samples, desc=f"calibrate {quant.qformat}", disable=not progress, leave=False):
                    m(row[None, :].to(model.device))  # [1, calib_max_seq_length]

        with _quiet():
            mtq.quantize(model, cfg, forward_loop)
    t_calib = time.perf_counter() - t1

    rows, num_passages = heldout_rows(tokenizer, quant.calib_max_seq_length)
    report = evaluate_quality(source_model, model, rows, quant, progress, num_passages)
    del source_model

    decoder = SUPPORTED_MODEL_TYPES[hf["model_type"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint_format == "hf":
        _export_hf(model, tokenizer, out_dir, dtype, source_dir, quant)
        echo(f"  quantized {source_dir.name} to {quant.qformat} (Hugging Face format) in {time.perf_counter() - t0:.1f} s")
        return report
    try:
        with _quiet(), torch.inference_mode():
            export_tensorrt_llm_checkpoint(
                model,
                decoder_type=decoder,
                dtype=getattr(torch, dtype),
                export_dir=out_dir,
                inference_tensor_parallel=tp_size,
                inference_pipeline_parallel=pp_size,
            )
    except (AssertionError, ValueError, NotImplementedError) as exc:
        raise QuantizeError(f"ModelOpt could not export {source_dir} as {quant.qformat}: {exc}", "try another qformat") from exc
    _finish_config(out_dir, hf, quant, decoder)
    echo(f"  quantized {source_dir.name} to {quant.qformat} in {time.perf_counter() - t0:.1f} s (calibration {t_calib:.1f} s)")
    return report


def _export_hf(model, tokenizer, out_dir: Path, dtype: str, source_dir: Path, quant: QuantConfig) -> None:
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    try:
        with _quiet(), torch.inference_mode():
            export_hf_checkpoint(model, dtype=getattr(torch, dtype), export_dir=out_dir)
    except (AssertionError, ValueError, NotImplementedError) as exc:
        raise QuantizeError(f"ModelOpt could not export {source_dir} as {quant.qformat}: {exc}", "try another qformat") from exc
    tokenizer.save_pretrained(str(out_dir))


def _finish_config(out_dir: Path, hf: dict, quant: QuantConfig, decoder: str) -> None:
    """The config.json fixes TensorRT-LLM's quantize.py applies after the ModelOpt export (without tensorrt_llm
    installed ModelOpt writes the config by hand and misses the RoPE base of transformers-5 configs)."""
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    rope = hf.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    config["rotary_base"] = float(rope_theta)
    rope_type = rope.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type", "default")
    config["rotary_scaling"] = None if rope_type == "default" else {**(hf.get("rope_scaling") or {}), **rope}
    config["model_type"] = decoder
    config["quantization"]["quant_algo"] = QUANT_ALGO[quant.qformat]
    config["quantization"]["kv_cache_quant_algo"] = KV_CACHE_QUANT_ALGO[quant.kv_cache_dtype]
    config["quantization"].setdefault("exclude_modules", [])
    if decoder == "qwen":
        config["qwen_type"] = hf["model_type"]
        config["norm_epsilon"] = hf["rms_norm_eps"]
        config["intermediate_size"] = hf["intermediate_size"]
    path.write_text(json.dumps(config, indent=4) + "\n")


# ---------------------------------------------------------------- a recipe


def _resolve(model: str) -> Path:
    from specdeploy.models import resolve

    return resolve(model)


def checkpoint_format(recipe: Recipe) -> str:
    """TensorRT-LLM checkpoints for the cpu and trtllm-engine backends; Hugging Face format for the LLM API."""
    from specdeploy import backends

    return backends.of(recipe).checkpoint_format


def _ranks(recipe: Recipe, m) -> tuple[int, int]:
    return (1, 1) if checkpoint_format(recipe) == "hf" else (m.tp_size, m.pp_size)


def needs_calibration(quant: QuantConfig) -> bool:
    return MODELOPT_CFG[quant.qformat] is not None or quant.kv_cache_dtype is not None


def _machine_memory() -> tuple[list[int], int | None]:
    """(memory of each GPU, RAM available) for the calibration plan."""
    from specdeploy import gpu as gpu_probe

    try:
        import psutil

        ram = int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        ram = None
    return [g.memory_bytes for g in gpu_probe.probe()], ram


def recipe_fingerprint(recipe: Recipe, role: str, source_hash: str) -> str:
    from specdeploy.artifacts import file_hash, fingerprint, tool_versions

    m = recipe.model(role)
    calib = m.quantization.calib_dataset
    model = to_plain(m)
    model["quantization"].pop("max_calib_hours", None)  # a limit on the run, not part of the checkpoint
    return fingerprint(
        stage=STAGE,
        source=source_hash,
        model=model,
        format=checkpoint_format(recipe),
        dtype=export_dtype(recipe.engine.dtype),
        calib=file_hash(Path(calib)) if calib != BUILTIN else file_hash(builtin_path(CALIB_FILE)),
        heldout=file_hash(builtin_path(HELDOUT_FILE)),
        tools=tool_versions(*TOOL_DISTRIBUTIONS),
    )


def quantize_recipe(recipe: Recipe, layout, force: bool = False, echo=print, progress: bool = True) -> dict:
    """Write `layout.checkpoint(role)` for the target and the draft; unchanged inputs are not redone.

    All inputs of both roles are checked before any model is loaded. Each checkpoint is written into a
    temporary folder and swapped in only when complete (with its manifest), so a failed run keeps the
    earlier checkpoint. Returns {role: QualityReport or None when up to date}.
    """
    from specdeploy.artifacts import Manifest, atomic_output, dir_hash, is_up_to_date, tool_versions

    plans = []
    for role in recipe.model_roles:  # an n-gram draft has no weights
        m = recipe.model(role)
        source = _resolve(m.model)
        pre = calibration.detect_prequantized(source)  # a ModelOpt export is used as is, without calibrating
        plan = None
        if pre is not None:
            calibration.check_prequantized(pre, m.quantization, recipe.backend, m.model, role)
        else:
            check_quant_config(m.quantization)
            hf = check_model(source, m.quantization, m.tp_size, m.pp_size)
            if m.quantization.calib_dataset != BUILTIN:
                read_passages(m.quantization.calib_dataset)
            if needs_calibration(m.quantization):
                plan = calibration.plan_calibration(hf, m.quantization, *_machine_memory())
                calibration.check_calibration(plan, m.quantization, m.model, role)
        source_hash = dir_hash(source)
        plans.append((role, m, source, source_hash, recipe_fingerprint(recipe, role, source_hash), pre, plan))

    reports = {}
    for role, m, source, source_hash, fp, pre, plan in plans:
        dest = layout.checkpoint(role)
        if not force and is_up_to_date(dest, fp):
            echo(f"{role}: up to date ({dest})")
            reports[role] = None
            continue
        q = m.quantization
        if pre is not None:
            with atomic_output(dest) as tmp:
                files = calibration.link_checkpoint(source, tmp)
                Manifest(
                    stage=STAGE,
                    recipe_name=recipe.name,
                    fingerprint=fp,
                    settings={**to_plain(m), "role": role, "format": "hf", "prequantized": True},
                    inputs={"source_dir": str(source), "source_hash": source_hash},
                    tool_versions=tool_versions(*TOOL_DISTRIBUTIONS),
                    extra={"quality": None, "prequantized_from": pre.source, "linked_files": files,
                           "quant_algo": QUANT_ALGO[q.qformat], "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO[q.kv_cache_dtype]},
                ).write(tmp)
            echo(f"{role}: {m.model} is already a ModelOpt {pre.qformat} export ({pre.source}); linked as the checkpoint "
                 f"{dest}, no calibration")  # fmt: skip
            reports[role] = None
            continue
        echo(f"{role}: quantizing {m.model} to {q.qformat}" + (f" + {q.kv_cache_dtype} KV cache" if q.kv_cache_dtype else ""))
        if plan is not None:
            echo(f"  {plan.summary()}")
        dtype = export_dtype(recipe.engine.dtype)
        with atomic_output(dest) as tmp:
            report = quantize_model(
                source, q, tmp, *_ranks(recipe, m), progress=progress, dtype=dtype, echo=echo,
                checkpoint_format=checkpoint_format(recipe),
            )
            Manifest(
                stage=STAGE,
                recipe_name=recipe.name,
                fingerprint=fp,
                settings={**to_plain(m), "dtype": dtype, "role": role, "format": checkpoint_format(recipe)},
                inputs={"source_dir": str(source), "source_hash": source_hash},
                tool_versions=tool_versions(*TOOL_DISTRIBUTIONS),
                extra={"quality": report.as_dict(), "quant_algo": QUANT_ALGO[q.qformat],
                       "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO[q.kv_cache_dtype]},
            ).write(tmp)
        echo(report.table(f"{role} ({m.model})"))
        echo(f"{role}: wrote {dest}")
        reports[role] = report
    return reports

