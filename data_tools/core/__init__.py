"""megassm.data_tools: corpora -> Megatron-compatible token shards -> batches.

    indexed.py       .bin/.idx writer and validated memory-mapped reader (Megatron's MMIDIDX layout)
    tokenizers.py    byte (built in), SentencePiece .model, Hugging Face tokenizer.json
    sources.py       input files (JSONL/.gz/.zst, Parquet, Arrow IPC, text) -> ordered work units
    encode.py        worker side: decode, parse, tokenize, count bad input
    shard_writer.py  resumable (numbered) shard writing under PREFIX.partial/
    preprocess.py    megassm-preprocess CLI and preprocess() function
    builtin.py       the embedded default corpus (Python stdlib sources), cached
    sampler.py       seeded permutations, exact-proportion interleaving, document split
    dataset.py       packed samples with seq_idx, blends
    streams.py       BPTT stream mode
    loader.py        build_data(): what the trainer calls
See docs/data.md.
"""
