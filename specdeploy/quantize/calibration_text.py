"""The text the quantize stage calibrates on and measures quality with: the built-in sets or the user's .txt/.jsonl
file, read into passages, tokenized, and packed into fixed-length rows (calibration samples, held-out rows).
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from specdeploy.core.errors import ConfigError
from specdeploy.quantize.formats import AWQ_MAX_CALIB_SIZE, WEIGHT_ONLY_MAX_CALIBRATION
from specdeploy.recipe.config import QuantConfig

BUILTIN = "builtin"
CALIB_FILE = "calibration.jsonl"
HELDOUT_FILE = "heldout.jsonl"


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("specdeploy") / "data" / "calib" / name))


def read_passages(path: str | Path) -> list[str]:
    """Passages of a .jsonl file ({"text": ...} per line, or a JSON string) or a .txt file (blank-line separated)."""
    path = Path(path)
    hint = 'pass a UTF-8 .txt file (passages separated by blank lines) or a .jsonl file with a "text" field per line'
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
                raise ConfigError(f'calibration file {path} line {lineno} has no string "text" field', hint)
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
