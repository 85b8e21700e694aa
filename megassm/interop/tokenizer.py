"""The run's tokenizer, written so that `AutoTokenizer.from_pretrained(OUT)` encodes text as training did.

    spec, note = tokenizer_spec(cfg, override)   # "byte", a tokenizer.json / .model path (checked against the
                                                 # shard manifests' sha256 where they record one)
    write_tokenizer(spec, out_dir)               # then verified: the same ids as megassm's tokenizer on probes

Training encodes without special tokens (no BOS; EOS appended per document), so the exported tokenizer adds none
either: a tokenizer.json's post-processor is dropped and SentencePiece's BOS is off. `byte` becomes an exact
byte-level `tokenizers` BPE (ids 0-255 = UTF-8 bytes, 256 = `<|endoftext|>`, no merges).
"""
from __future__ import annotations

import json
import os

from megassm.config import Config

__all__ = ["TokenizerExportError", "tokenizer_spec", "write_tokenizer", "EOS_BYTE_TOKEN"]

EOS_BYTE_TOKEN = "<|endoftext|>"
_PROBES = ["Hello, world!", "  leading spaces and\ttabs\nnew lines\r\n", "déjà vu — naïve café 日本語 🙂",
           "def f(x):\n    return x ** 2  # comment", "1234567890 3.14159 e=mc^2", ""]


class TokenizerExportError(ValueError):
    pass


def _manifest_tokenizers(paths: list[str]) -> list[tuple[str, dict]]:
    out = []
    for prefix in paths:
        mp = prefix + ".manifest.json"
        if os.path.isfile(mp):
            with open(mp) as f:
                tok = (json.load(f) or {}).get("tokenizer")
            if tok:
                out.append((mp, tok))
    return out


def tokenizer_spec(cfg: Config, override: str | None) -> str | None:
    """The tokenizer the run trained with: `override` (checked against the manifests), data.tokenizer for the
    builtin corpus, `byte` when the shards' manifests say so; None when it cannot be known (shards without a
    manifest, or a file tokenizer whose path the manifests do not record)."""
    d = cfg.data
    recorded = _manifest_tokenizers(d.paths) if not d.builtin else []
    if override is not None:
        if override != "byte" and not os.path.exists(override):
            raise TokenizerExportError(f"--tokenizer {override}: no such file or folder")
        if recorded:
            from megassm.data_tools.tokenizers import load_tokenizer

            sha = load_tokenizer(override).sha256
            for mp, tok in recorded:
                if tok.get("sha256") and tok["sha256"] != sha:
                    raise TokenizerExportError(f"--tokenizer {override} is not the tokenizer {mp} was made with "
                                               f"({tok.get('name')}, sha256 {tok['sha256'][:12]}...)")
        return override
    if d.builtin:
        return d.tokenizer
    if recorded and all(tok.get("name") == "byte" for _, tok in recorded):
        return "byte"
    if recorded:
        mp, tok = recorded[0]
        raise TokenizerExportError(f"{mp}: the shards were made with {tok.get('name')} (sha256 "
                                   f"{str(tok.get('sha256'))[:12]}...), whose path is not recorded: pass "
                                   "--tokenizer PATH (the same file), or --no-tokenizer")
    return None


def _byte_level():
    """A `tokenizers` Tokenizer equal to megassm's byte tokenizer (ids 0-255 are UTF-8 bytes, 256 is EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    byte_char = _bytes_to_unicode()
    assert sorted(byte_char.values()) == sorted(alphabet)
    vocab = {byte_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_BYTE_TOKEN])  # id 256
    return tok


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character table (the one the ByteLevel pre-tokenizer applies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tokenizer(spec: str, out_dir: str) -> str:
    """Write the tokenizer files into out_dir and check AutoTokenizer reads them back to the same ids as
    megassm's tokenizer. Returns a one-line description."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megassm.data_tools.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, load_tokenizer

    ours = load_tokenizer(spec)
    if isinstance(ours, ByteTokenizer):
        fast = PreTrainedTokenizerFast(tokenizer_object=_byte_level(), eos_token=EOS_BYTE_TOKEN)
        fast.save_pretrained(out_dir)
        what = f"byte-level tokenizer (ids 0-255 = UTF-8 bytes, 256 = {EOS_BYTE_TOKEN})"
    elif isinstance(ours, HFTokenizer):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(ours.spec)
        tok.post_processor = None  # training added no BOS / special tokens
        eos = tok.id_to_token(ours.eos_id) if ours.eos_id is not None else None
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(out_dir)
        what = f"tokenizer.json from {ours.spec}"
    elif isinstance(ours, SentencePieceTokenizer):
        import shutil

        shutil.copyfile(ours.spec, os.path.join(out_dir, "tokenizer.model"))
        eos = ours._sp.id_to_piece(ours.eos_id) if ours.eos_id is not None else None
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "SentencePieceBackend", "legacy": True, "add_bos_token": False,
                       "add_eos_token": False, "eos_token": eos, "bos_token": None, "unk_token": None}, f, indent=2)
        what = f"SentencePiece model from {ours.spec}"
    else:
        raise TokenizerExportError(f"tokenizer {spec}: no export for {type(ours).__name__}")
    back = AutoTokenizer.from_pretrained(out_dir)
    for text in _PROBES:
        want, got = list(ours.encode(text)), back.encode(text, add_special_tokens=False)
        if want != got:
            raise TokenizerExportError(f"tokenizer {spec}: the exported tokenizer encodes {text!r} as {got[:12]}..., "
                                       f"megassm's as {want[:12]}...: not exact, so it is not exported (pass "
                                       "--no-tokenizer to export the model alone)")
    return what
