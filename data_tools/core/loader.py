"""What the trainer calls: `build_data(cfg.data, ...)` -> batches for this data-parallel rank.

    data = build_data(data_cfg, seq_len=512, micro_batch=4, global_batch=16, dp_rank=0, dp_size=2, seed=1234)
    batch = data.next_batch()   # tokens, labels, seq_idx, reset

Step k's global batch is global samples [k*G, (k+1)*G). Rank r owns the contiguous rows
r*G/dp ... (r+1)*G/dp - 1 of it and serves them as micro-batches of `micro_batch` rows, in order. Because
a sample is a pure function of (seed, global index), the concatenation of all ranks' micro-batches of a
step is the same for any dp_size, and `state_dict()` (the next global sample) resumes the exact stream.

BPTT (`bptt=True`): row b of the global batch is stream b (streams.py); step k serves window k of
every stream; the state is k.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Iterator

import numpy as np

from .dataset import BlendedSamples, PackedSamples, TokenDataset, stack_samples
from .sampler import SPLIT_NAMES, split_documents
from .streams import BPTTStreams, DocumentSequence

log = logging.getLogger("megassm.data")

STATE_VERSION = 1
IGNORE_INDEX = -100  # a label the loss skips (models/lm.py)
EVAL_SEED = 0  # validation order is fixed, so val loss compares across runs with different seeds
_SALT_SPLIT = 1000  # salt = dataset index + split * 1000: independent orders per dataset and split


def resolve_paths(data_cfg) -> list[str]:
    builtin = getattr(data_cfg, "builtin", None)
    paths = list(getattr(data_cfg, "paths", []) or [])
    if builtin and paths:
        raise ValueError("data.builtin and data.paths are both set: pass data.builtin=none to train on data.paths")
    if builtin:
        from .builtin import ensure_builtin_corpus

        return [ensure_builtin_corpus(builtin, tokenizer=data_cfg.tokenizer, cache_dir=data_cfg.cache_dir)]
    if not paths:
        raise ValueError("set data.paths (shard prefixes from megassm-preprocess) or data.builtin (e.g. stdlib)")
    return paths


def manifest_vocab(datasets: list[TokenDataset]) -> tuple[int, int | None]:
    """(vocab_size, eos_id) from the manifests, which must agree; scanned ids when there are none."""
    toks = [(d.prefix, d.tokenizer) for d in datasets if d.tokenizer]
    if toks:
        first_prefix, first = toks[0]
        for prefix, t in toks[1:]:
            if t.get("sha256") != first.get("sha256"):
                raise ValueError(
                    f"data.paths mix tokenizers: {first_prefix} uses {first.get('name')} and "
                    f"{prefix} uses {t.get('name')}; preprocess them with one tokenizer"
                )
        vocab, eos = int(first["vocab_size"]), first.get("eos_id")
    else:
        vocab, eos = 0, None
    bare = [d for d in datasets if not d.tokenizer]
    if bare:
        scanned = max(d.max_token_id() for d in bare) + 1
        log.warning("%s: no manifest (shards made by Megatron?): the .bin / .idx are not checked against a record "
                    "of their sizes and hashes, and the vocabulary size is taken from the largest token id (%d)",
                    ", ".join(d.prefix for d in bare), scanned)
        vocab = max(vocab, scanned)
    return vocab, eos


class DataPipeline:
    def __init__(self, data_cfg, seq_len: int, micro_batch: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 1234, bptt: bool = False):
        if seq_len < 1 or micro_batch < 1 or global_batch < 1:
            raise ValueError("seq_len, micro_batch and global_batch must be positive")
        if global_batch % (micro_batch * dp_size) != 0:
            raise ValueError(
                f"global_batch={global_batch} must be a multiple of micro_batch x dp_size = {micro_batch} x {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.seq_len, self.micro_batch, self.global_batch = seq_len, micro_batch, global_batch
        self.dp_rank, self.dp_size, self.seed, self.bptt = dp_rank, dp_size, seed, bptt
        self.rows_per_rank = global_batch // dp_size
        self.accumulation = self.rows_per_rank // micro_batch

        paths = resolve_paths(data_cfg)
        weights = getattr(data_cfg, "weights", None)
        if weights is not None and len(weights) != len(paths):
            raise ValueError(f"data.weights has {len(weights)} entries but there are {len(paths)} data paths")
        self.weights = list(weights) if weights is not None else [1.0] * len(paths)
        self.datasets = [TokenDataset(p) for p in paths]
        self.vocab_size, self.eos_id = manifest_vocab(self.datasets)
        self.splits = [split_documents(d.num_docs, data_cfg.split) for d in self.datasets]

        # train: packed samples (or BPTT streams); valid: packed samples with a fixed order
        if bptt:
            seq = DocumentSequence([(d, s[0]) for d, s in zip(self.datasets, self.splits)], self.weights, seed)
            self._streams = BPTTStreams(seq, global_batch, seq_len)
        else:
            self._train = self._blend(0, seed)
        self._valid = self._blend(1, EVAL_SEED, optional=True)

        self._next = 0  # packed: global sample index where the current step starts; bptt: window k
        self._micro = 0  # micro-batches of the current step already served on this rank
        self.prefetch = int(getattr(data_cfg, "prefetch", 0) or 0)
        self._thread = None
        self._start_prefetch()

    # --- construction --------------------------------------------------------------------------------
    def _blend(self, split: int, seed: int, optional: bool = False):
        sources, weights = [], []
        for i, (d, s) in enumerate(zip(self.datasets, self.splits)):
            if len(s[split]) == 0 or int(d.doc_lengths[s[split]].sum()) == 0:
                if not optional:
                    raise ValueError(f"{d.prefix}: the {SPLIT_NAMES[split]} split has no documents "
                                     f"({d.num_docs} documents in all; check data.split)")
                continue
            sources.append(PackedSamples(d, s[split], self.seq_len, seed, i + _SALT_SPLIT * split,
                                         f"the {SPLIT_NAMES[split]} split"))
            weights.append(self.weights[i])
        if not sources:
            log.warning("no %s documents (data.split is too small for this corpus); evaluation is skipped",
                        SPLIT_NAMES[split])
            return None
        return sources[0] if len(sources) == 1 else BlendedSamples(sources, weights)

    def check_token_ids(self, vocab: int) -> None:
        """Every token id this pipeline serves must be < `vocab`, the model's vocabulary, whatever the manifests
        say (TokenDataset.set_vocab_limit: small datasets are scanned now, every read is checked). Batches
        prefetched before are made again under the check."""
        self._stop_prefetch()
        for d in self.datasets:
            d.set_vocab_limit(vocab)
        self._start_prefetch()

    # --- batches -------------------------------------------------------------------------------------
    def _rows(self, micro: int) -> np.ndarray:
        first = self.dp_rank * self.rows_per_rank + micro * self.micro_batch
        return first + np.arange(self.micro_batch)

    def _make(self, step_pos: int, micro: int) -> dict:
        rows = self._rows(micro)
        if self.bptt:
            return stack_samples([self._streams.window(int(r), step_pos) for r in rows])
        return stack_samples([self._train.sample(step_pos + int(r)) for r in rows], reset_all=True)

    def _advance(self, step_pos: int, micro: int) -> tuple[int, int]:
        micro += 1
        if micro == self.accumulation:
            return step_pos + (1 if self.bptt else self.global_batch), 0
        return step_pos, micro

    def next_batch(self) -> dict:
        """The next micro-batch of this rank."""
        if self._thread is not None:
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._thread = None
                raise item
            (pos, micro), batch = item
            assert (pos, micro) == (self._next, self._micro), "prefetch out of order"
        else:
            batch = self._make(self._next, self._micro)
        self._next, self._micro = self._advance(self._next, self._micro)
        return batch

    # --- prefetch ------------------------------------------------------------------------------------
    def _producer(self, pos: int, micro: int, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                batch = self._make(pos, micro)
                while not stop.is_set():
                    try:
                        self._queue.put(((pos, micro), batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                pos, micro = self._advance(pos, micro)
        except BaseException as e:  # surfaced in next_batch
            self._queue.put(e)

    def _start_prefetch(self) -> None:
        if self.prefetch <= 0:
            return
        self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._producer, args=(self._next, self._micro, self._stop),
                                        name="megassm-data-prefetch", daemon=True)
        self._thread.start()

    def _stop_prefetch(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()
        self._thread = None

    def close(self) -> None:
        self._stop_prefetch()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # --- evaluation ----------------------------------------------------------------------------------
    def eval_batches(self, num_samples: int) -> Iterator[dict]:
        """This rank's micro-batches of the held-out set: validation samples 0 .. num_samples-1 (a fixed order,
        the same for any layout), split into contiguous equal shares over the data-parallel ranks. Every rank
        gets the same number of full-size micro-batches, so collectives (FSDP2, pipeline schedules) line up;
        rows past the set repeat a sample with every label -100 (ignored), so a token-weighted mean of the
        batches' losses is the mean over exactly the set's tokens."""
        import torch

        if self._valid is None or num_samples <= 0:
            return
        share = -(-num_samples // self.dp_size)
        first = self.dp_rank * share
        mine = max(0, min(share, num_samples - first))
        for lo in range(0, share, self.micro_batch):
            rows = [first + j if j < mine else None for j in range(lo, lo + self.micro_batch)]
            samples = [self._valid.sample(r if r is not None else 0) for r in rows]
            batch = stack_samples(samples, reset_all=True)
            pad = torch.tensor([r is None for r in rows])
            if pad.any():  # labels may view the same buffer as tokens (shifted by one): write a copy
                batch["labels"] = batch["labels"].clone()
                batch["labels"][pad] = IGNORE_INDEX
            yield batch

    def valid_batches(self, num_batches: int) -> Iterator[dict]:
        """`num_batches` micro-batches of validation samples for this rank: the same ones every call
        (eval_batches over num_batches x micro_batch x dp_size samples)."""
        return self.eval_batches(num_batches * self.micro_batch * self.dp_size)

    # --- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        d = {
            "version": STATE_VERSION,
            "mode": "bptt" if self.bptt else "packed",
            "seed": self.seed,
            "seq_len": self.seq_len,
            "micro_in_step": self._micro,
        }
        if self.bptt:
            # every stream s is at token window * seq_len of its own document sequence
            d.update(window=self._next, num_streams=self.global_batch)
        else:
            d.update(consumed_samples=self._next, global_batch=self.global_batch)
        if self._micro:
            d.update(micro_batch=self.micro_batch, dp_size=self.dp_size)
        return d

    def load_state_dict(self, d: dict) -> None:
        mode = "bptt" if self.bptt else "packed"
        if d.get("version") != STATE_VERSION or d.get("mode") != mode:
            raise ValueError(f"data state: expected version {STATE_VERSION} in {mode} mode, got "
                             f"version {d.get('version')} in {d.get('mode')} mode")
        if d["seq_len"] != self.seq_len:
            raise ValueError(f"data state: saved with seq_len={d['seq_len']}, now {self.seq_len}: the stream differs")
        if d["seed"] != self.seed:
            log.warning("data state: saved with seed %s, now %s: the sample order changes", d["seed"], self.seed)
        micro = int(d.get("micro_in_step", 0))
        if micro and (d.get("micro_batch"), d.get("dp_size")) != (self.micro_batch, self.dp_size):
            raise ValueError("data state: saved in the middle of a step; resume with the same micro_batch and dp_size")
        if self.bptt:
            if d["num_streams"] != self.global_batch:
                raise ValueError(f"data state: {d['num_streams']} BPTT streams saved, global_batch is now "
                                 f"{self.global_batch}: streams cannot be remapped")
            pos = int(d["window"])
        else:
            pos = int(d["consumed_samples"])
        self._stop_prefetch()
        self._next, self._micro = pos, micro
        self._start_prefetch()


def build_data(data_cfg, seq_len: int, micro_batch: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
               seed: int = 1234, bptt: bool = False) -> DataPipeline:
    return DataPipeline(data_cfg, seq_len, micro_batch, global_batch, dp_rank, dp_size, seed, bptt)
