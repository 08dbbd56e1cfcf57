"""Tokenizers: bytes (the default) or a Hugging Face tokenizer.json, each with the
end-of-text token that separates documents. The token cache is built in token_cache.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

BYTE_VOCAB_SIZE = 257  # 256 byte values and the end-of-document token

_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")


class DataError(ValueError):
    """Bad data settings (no files, unreadable tokenizer, too little text)."""


class ByteTokenizer:
    """Each UTF-8 byte is a token; 256 marks the end of a document."""

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eos_id = 256

    def encode_file(self, path: Path) -> np.ndarray:
        return self.encode_bytes(path.read_bytes())

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def encode_text(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (install prime-train[hf])."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                f"data.tokenizer = {str(path)!r} needs the `tokenizers` package: "
                "install prime-train[hf] (uv pip install tokenizers) or use 'byte'"
            ) from None
        if not path.is_file():
            raise DataError(f"tokenizer file not found: {path} (give a tokenizer.json or 'byte')")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise DataError(f"cannot load tokenizer {path}: {e}") from None
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.name = f"hf-{digest}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.path = path
        found = [(t, self._tok.token_to_id(t)) for t in _EOS_NAMES]
        self.eos_token, self.eos_id = next(
            ((t, i) for t, i in found if i is not None), (None, None)
        )

    def encode_file(self, path: Path) -> np.ndarray:
        return self.encode_bytes(path.read_bytes())

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return self.encode_text(data.decode("utf-8", errors="replace"))

    def encode_text(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def make_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(Path(spec).expanduser())
