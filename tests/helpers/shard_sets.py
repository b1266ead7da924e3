"""Small shard sets for cache tests (real parquet shards with a real manifest)."""

from __future__ import annotations

from pathlib import Path

from cs3ray.data.corpus import open_corpus
from cs3ray.data.shards import ShardSpec, prepare_shards
from cs3ray.storage import open_url


def make_shard_set(dest: Path, n_shards: int = 4, samples_per_shard: int = 32, seq_len: int = 16,
                   url: str | None = None, options: dict | None = None) -> tuple[str, dict]:
    """Prepare about `n_shards` train shards from generated text under `dest` (or `url`)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    corpus_file = dest.parent / f"{dest.name}-corpus.txt"
    need = int((n_shards + 0.5) * samples_per_shard * (seq_len + 1) / 0.95)
    corpus_file.write_text("".join(f"line {i} of the test corpus, with some words\n" for i in range(need // 40 + 1)))
    target = open_url(url or str(dest), options)
    manifest = prepare_shards(open_corpus(str(corpus_file)), target,
                              ShardSpec(seq_len, samples_per_shard, 0.05, 10**8, 0))
    return target.url, manifest
