"""Tokenizers users train with: a byte-level BPE trained offline, self-describing JSON, the vocabulary
it implies, UTF-8-safe streaming of its tokens and `cs3 data tokenizer` (no Ray)."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from cs3ray.config import ConfigError, build_config, load_config
from cs3ray.data import train_tokenizer
from cs3ray.models import (
    BPETokenizer,
    ByteTokenizer,
    TokenizerError,
    check_same,
    load_tokenizer,
    padded_vocab,
    tokenizer_from_json,
)
from cs3ray.models.generate import SamplingParams
from cs3ray.serve.sequence import GenRequest, Sequence
from cs3ray_cli.main import app

WORDS = ["the", "model", "tokenizer", "héllo", "世界", "données", "def", "return", "self", "ray", "🙂", "train"]
# ByteTokenizer().to_json() as checkpoints written before BPE support hold it, byte for byte.
OLD_BYTE_JSON = '{"type": "byte", "bos_id": 256, "eos_id": 257, "pad_id": 258, "vocab_size": 259}'
TEXT = "héllo 世界 🙂\n\tdef train(self): return ray.données"


def write_corpus(folder) -> str:
    """A small multilingual text corpus (about 60 KB in 6 files)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(400)]
        (folder / f"doc{i}.txt").write_text("\n".join(lines), encoding="utf-8")
    return str(folder)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, str]:
    """(corpus dir, tokenizer dir) of a BPE with 300 ids trained by the library function."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = write_corpus(root / "corpus")
    summary = train_tokenizer(corpus, 300, str(root / "tok"))
    assert summary["vocab_size"] == 300 and summary["documents"] == 6
    return corpus, str(root / "tok")


def test_a_trained_bpe_round_trips_text_and_compresses_it(trained):
    corpus, folder = trained
    tok = load_tokenizer(folder)
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 300
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (0, 1, 2)
    for text in (TEXT, "", "   leading spaces", "a\x00b\u200d", open(f"{corpus}/doc0.txt", encoding="utf-8").read()):
        ids = tok.encode(text, bos=True, eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids) == text
        assert tok.encode_batch([text, text]) == [ids[1:-1]] * 2
    doc = open(f"{corpus}/doc1.txt", encoding="utf-8").read()
    assert len(tok.encode(doc)) < 0.6 * len(doc.encode())  # merges learned from the corpus
    assert max(tok.encode(doc)) < 300 and tok.decode([299, 5000, -1]) == tok.decode([299])


def test_tokenizer_json_is_self_describing_and_old_byte_json_loads(trained):
    _, folder = trained
    byte, bpe = ByteTokenizer(), load_tokenizer(folder)
    assert tokenizer_from_json(OLD_BYTE_JSON) == byte == load_tokenizer("byte")
    assert json.loads(byte.to_json())["type"] == "byte"
    stored = json.loads(bpe.to_json())
    assert stored["type"] == "bpe" and stored["vocab_size"] == 300 and stored["hf"]["model"]["type"] == "BPE"
    again = tokenizer_from_json(bpe.to_json())
    assert again.encode(TEXT) == bpe.encode(TEXT) and again.token_bytes() == bpe.token_bytes()
    check_same(again, bpe, "x")  # the plain Hugging Face file and the stored JSON are one tokenizer
    # A cs3ray JSON copied out of a checkpoint is a valid data.tokenizer too.
    copied = f"{folder}/copied.json"
    open(copied, "w").write(bpe.to_json())
    check_same(load_tokenizer(copied), bpe, "x")
    with pytest.raises(TokenizerError, match="tokenizer type 'wordpiece'"):
        tokenizer_from_json('{"type": "wordpiece"}')
    with pytest.raises(TokenizerError, match="made with tokenizer byte, but the config names bpe"):
        check_same(byte, bpe, "shard set 's'")


def test_a_foreign_or_broken_tokenizer_file_is_one_sentence(tmp_path, trained):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a JSON object"):
        load_tokenizer(str(tmp_path))
    hf = json.loads(open(f"{trained[1]}/tokenizer.json").read())
    hf["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    bad.write_text(json.dumps(hf))
    with pytest.raises(TokenizerError, match="byte-level BPE tokenizers only"):
        load_tokenizer(str(bad))


def test_vocab_size_defaults_to_the_tokenizer_padded_and_smaller_is_an_error(trained, tmp_path):
    _, folder = trained
    cfg = load_config(None, [f"data.tokenizer={folder}"])
    assert cfg.model.vocab_size == cfg.model.args().vocab_size == 304 == padded_vocab(load_tokenizer(folder))
    assert load_config(None, []).model.args().vocab_size == 264  # byte: the preset's, 259 padded
    assert load_config(None, [f"data.tokenizer={folder}", "model.vocab_size=512"]).model.args().vocab_size == 512
    for overrides, words in (([f"data.tokenizer={folder}", "model.vocab_size=296"], ["296", "bpe", "300", "304"]),
                             (["model.vocab_size=256"], ["256", "byte", "259", "264"]),
                             ([f"data.tokenizer={tmp_path}/none"], ["data.tokenizer", "none"])):
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert all(w in str(err.value) for w in words) and len(str(err.value).splitlines()) == 1, err.value
    # A checkpoint's stored config names the training machine's file and its vocab_size: it loads anywhere.
    stored = cfg.model_dump(mode="json")
    stored["data"]["tokenizer"] = "/elsewhere/tokenizer.json"
    assert build_config(stored).model.args().vocab_size == 304


def test_streaming_decodes_bpe_tokens_that_split_characters(trained):
    tok = load_tokenizer(trained[1])
    table = tok.token_bytes()
    ids = tok.encode(TEXT)

    def valid(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert any(not valid(table[i]) for i in ids)  # some token ends inside a character
    seq = Sequence(GenRequest([tok.eos_id], SamplingParams(max_tokens=1000)), 0, tok.eos_id, table)
    pieces = []
    for i in ids + [tok.pad_id, 301]:  # a special and an id past the tokenizer carry no text
        seq.accept(i)
        pieces.append(seq.flush())
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) == TEXT
    seq.accept(tok.eos_id)
    assert seq.finished == "stop"


def test_cli_trains_a_tokenizer_and_bad_arguments_are_one_line(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    res = CliRunner().invoke(app, ["data", "tokenizer", corpus, "--vocab", "280", "--out", str(tmp_path / "t"),
                                   "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["vocab_size"] == 280 and summary["path"].endswith("t/tokenizer.json")
    assert load_tokenizer(str(tmp_path / "t")).decode(load_tokenizer(str(tmp_path / "t")).encode(TEXT)) == TEXT
    for args, word in ((["--vocab", "100"], "259"), (["--vocab", "70000"], "65536"),
                       (["--vocab", "300", "--format", "csv"], "csv")):
        res = CliRunner().invoke(app, ["data", "tokenizer", corpus, "--out", str(tmp_path / "u"), *args])
        assert res.exit_code == 2 and word in res.output and "Traceback" not in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
    res = CliRunner().invoke(app, ["data", "tokenizer", str(tmp_path / "missing"), "--vocab", "300", "--out",
                                   str(tmp_path / "u")])
    assert res.exit_code == 2 and "does not exist" in res.output and len(res.output.strip().splitlines()) == 1
