"""Tokenizers behind one small interface.

    tok = load_tokenizer("byte")                      # built in: bytes 0..255, EOS 256, vocab 257
    tok = load_tokenizer("path/to/tokenizer.model")   # SentencePiece (e.g. Mistral-7B's)
    tok = load_tokenizer("path/to/tokenizer.json")    # Hugging Face `tokenizers`
    tok.name, tok.vocab_size, tok.eos_id, tok.sha256, tok.encode(text), tok.decode(ids)

`sha256` identifies the tokenizer (the model file's hash; a fixed string's for `byte`) and is recorded
in every shard manifest, so shards made with different tokenizers are never mixed silently.
A spec is resolved the same way in every worker process, so workers are started with the spec string.
"""
from __future__ import annotations

import abc

import hashlib
import os

import numpy as np


class TokenizerError(ValueError):
    pass


class Tokenizer(abc.ABC):
    """Interface of every tokenizer (byte, SentencePiece, HF tokenizer.json)."""

    name: str
    spec: str
    vocab_size: int
    eos_id: int | None
    sha256: str

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        ...

    @abc.abstractmethod
    def decode(self, ids) -> str:
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no EOS), as int64 arrays. Subclasses batch when the backend can."""
        return [np.asarray(self.encode(t), dtype=np.int64) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and EOS = 256. No files, no training, identical everywhere."""

    IDENTITY = "megassm byte tokenizer v1: ids 0-255 are UTF-8 bytes, 256 is end of document"

    def __init__(self):
        self.name = self.spec = "byte"
        self.vocab_size = 257
        self.eos_id = 256
        self.sha256 = hashlib.sha256(self.IDENTITY.encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # surrogates (possible after lossy decoding upstream) become '?', never an exception
        return [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` file. No BOS is added; EOS is the model's eos id."""

    def __init__(self, path: str):
        try:
            import sentencepiece as spm
        except ImportError:
            raise TokenizerError(
                f"{path}: SentencePiece tokenizers need the sentencepiece package (pip install sentencepiece)"
            ) from None
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with its own text
            raise TokenizerError(f"{path}: not a readable SentencePiece model: {e}") from None
        self.spec = path
        self.name = "sentencepiece:" + os.path.basename(path)
        self.vocab_size = int(self._sp.vocab_size())
        eos = int(self._sp.eos_id())
        self.eos_id = eos if eos >= 0 else None
        self.sha256 = _file_sha256(path)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # num_threads=1: parallelism comes from megassm's worker processes, not hidden C++ threads
        return [np.asarray(ids, dtype=np.int64) for ids in self._sp.encode(texts, num_threads=1)]

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (tokenizers package). EOS: the first of the usual end-of-text
    tokens the vocabulary has (</s>, <|endoftext|>, <|end_of_text|>, <eos>, ...)."""

    def __init__(self, path: str):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker process
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise TokenizerError(f"{path}: tokenizer.json files need the tokenizers package (pip install tokenizers)") from None
        try:
            self._tok = _HF.from_file(path)
        except Exception as e:
            raise TokenizerError(f"{path}: not a readable Hugging Face tokenizer.json: {e}") from None
        self.spec = path
        self.name = "hf:" + os.path.basename(path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.eos_id = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        self.sha256 = _file_sha256(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str) -> Tokenizer:
    """`byte`, a SentencePiece model file, a `tokenizer.json`, or a folder holding one of them."""
    if spec == "byte":
        return ByteTokenizer()
    path = spec
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
        else:
            raise TokenizerError(f"{spec}: folder has no tokenizer.json or tokenizer.model")
    if not os.path.isfile(path):
        raise TokenizerError(
            f"{spec}: unknown tokenizer: not 'byte' and no such file "
            "(give 'byte', a SentencePiece .model file or a Hugging Face tokenizer.json)"
        )
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"{"):  # JSON -> Hugging Face; anything else is tried as a SentencePiece proto
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)


def tokenizer_info(tok: Tokenizer) -> dict:
    return {"name": tok.name, "sha256": tok.sha256, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}

