"""Tokenizers: byte-level BPE (Hugging Face `tokenizers`) or sentencepiece (unigram / BPE), one format.

Every kind ends up as a `tokenizer.json` that `tokenizers.Tokenizer` runs and that
`transformers.PreTrainedTokenizerFast` loads (with `tokenizer_config.json` / `special_tokens_map.json` beside
it), so preparation, training, evaluation and exported checkpoints all tokenize with the same file.
A sentencepiece model is converted (pieces, scores, merges) and its encodings match sentencepiece's own.

Vocabulary layout: `<|endoftext|>` among the first ids, learned pieces, filler `<|unused_i|>` tokens when the
corpus was too small to learn `vocab_size - 1` pieces, and `<|mask|>` as the LAST id (MoEP-MSIT reserves
`vocab_size - 1` as its mask token). The size is therefore always exactly `vocab_size`.
Round trip: `decode(encode(x)) == x` for any text (byte fallback), except that the sentencepiece kinds map a
literal U+2581 '▁' in the input to a space.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from moep_ds.data.config import TokenizerConfig
from moep_ds.data.errors import DataError
from moep_ds.errors import hub_error_reason

logger = logging.getLogger(__name__)

EOT = "<|endoftext|>"
MASK = "<|mask|>"
UNK = "<unk>"
TOKENIZER_FILE = "tokenizer.json"
HUB = "hf:"  # data.tokenizer.path hf:REPO_ID: the tokenizer.json of a Hugging Face hub repository
# what an export copies so that PreTrainedTokenizerFast.from_pretrained(dir) works
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LONG_TEXT = 1 << 14
_SAFE_BREAK = re.compile(r"(?<=\S\n)(?=\S)")
SP_MAX_SENTENCES = 2_000_000  # sentencepiece holds its training sentences in memory; sample beyond this


class TextTokenizer:
    """A `tokenizers.Tokenizer` with the ids the pipeline needs. Special-token text in the input (e.g. a
    literal `<|endoftext|>`) encodes to that special id, as GPT-2 tokenizers do."""

    def __init__(self, tok: Tokenizer, source: str = "<memory>"):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eot_id = tok.token_to_id(EOT)
        if eot_id is None:
            raise DataError(f"tokenizer {source} has no end-of-text token {EOT!r}")
        self.eot_id: int = eot_id
        self.mask_id: int | None = tok.token_to_id(MASK)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Long texts are encoded in pieces cut at safe line breaks (`tokenizers` slows down super-linearly
        on megabyte-long inputs); the ids are the same as encoding the whole text."""
        pieces = [split_at_line_breaks(t) for t in texts]
        flat = [p for ps in pieces for p in ps]
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # no offsets when available
        encoded = iter(encode(flat, add_special_tokens=False))
        out = []
        for ps in pieces:
            ids: list[int] = []
            for _ in ps:
                ids.extend(next(encoded).ids)
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def split_at_line_breaks(text: str, size: int = LONG_TEXT) -> list[str]:
    """`text` in pieces of about `size` characters, each cut right after a newline that has non-space
    characters on both sides. For the tokenizers trained here (and GPT-2 style byte-level ones) no
    pre-token and no learned piece spans such a newline, so encoding the pieces equals encoding the text."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = _SAFE_BREAK.search(text, start + size)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig, out_dir: str | os.PathLike,
                    seed: int = 0) -> TextTokenizer:
    """Train a tokenizer of exactly `cfg.vocab_size` ids on `texts` (documents) and save it in `out_dir`; the same
    texts and seed give the same tokenizer (a sentencepiece one trains on a sample of a large corpus drawn with
    `seed`: sample_lines)."""
    if cfg.kind == "bpe":
        tok = train_byte_bpe(texts, cfg.vocab_size - 1)
    else:
        model = train_sentencepiece(texts, cfg.kind.removeprefix("sentencepiece_"), cfg.vocab_size - 1, seed)
        tok = sentencepiece_to_tokenizer(model)
    complete_vocab(tok, cfg.vocab_size)
    save_tokenizer(tok, out_dir)
    return TextTokenizer(tok, str(out_dir))


def train_byte_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE: lossless on any text, no unknown token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_sentencepiece(texts: Iterable[str], model_type: str, vocab_size: int, seed: int = 0) -> bytes:
    """A serialized sentencepiece ModelProto trained with lossless settings (identity normalisation,
    whitespace kept, byte fallback), at most `vocab_size` pieces; beyond SP_MAX_SENTENCES lines it trains on a
    sample drawn with `seed`."""
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        _train_sentencepiece(spm, sample_lines(texts, SP_MAX_SENTENCES, seed), model, model_type, vocab_size)
    except RuntimeError as err:  # e.g. "Vocabulary size is smaller than required_chars. 299 vs 302. ..."
        reason = str(err).splitlines()[-1].split("] ")[-1]
        raise DataError(f"sentencepiece {model_type} with vocab_size {vocab_size + 1} failed: {reason}") from err
    return model.getvalue()


def _train_sentencepiece(spm, lines: list[str], model: io.BytesIO, model_type: str, vocab_size: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type=model_type,
        vocab_size=vocab_size,
        hard_vocab_limit=False,  # a small corpus yields fewer pieces; complete_vocab() fills up
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
        user_defined_symbols=[EOT],
        input_sentence_size=0,  # the lines are sample_lines' sample already
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )


def sample_lines(texts: Iterable[str], limit: int, seed: int) -> list[str]:
    """The documents' lines, or a uniform sample of `limit` of them drawn with `seed` (reservoir sampling) when
    there are more: sentencepiece's own sampling cannot be seeded, and two preparations of one corpus (on two
    nodes) must train the same tokenizer."""
    rng = random.Random(seed)
    sample: list[str] = []
    for i, line in enumerate(_lines(texts)):
        if i < limit:
            sample.append(line)
        elif (j := rng.randrange(i + 1)) < limit:
            sample[j] = line
    return sample


def _lines(texts: Iterable[str]) -> Iterator[str]:
    # sentencepiece learns within sentences; a document's lines are its sentences
    for text in texts:
        yield from (line for line in text.split("\n") if line.strip())


def sentencepiece_to_tokenizer(model_proto: bytes) -> Tokenizer:
    """A sentencepiece ModelProto as an equivalent `tokenizers.Tokenizer` (same ids, same segmentation)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
        model = models.Unigram(pieces, 0, True)  # unk_id 0, byte_fallback
    else:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        model = models.BPE(vocab, bpe_merges(pieces, vocab), unk_token=UNK, byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    # sentencepiece splits before each space, which it writes as U+2581
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    return tok


def bpe_merges(pieces: list[tuple[str, float]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges implied by a sentencepiece BPE vocabulary: every split of a piece into two pieces, ranked by
    the merged piece's score (higher first), ties by the parts' ids (as transformers' SentencePieceExtractor)."""
    ranked = []
    for piece, score in pieces:
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((-score, n, lr) for n, lr in enumerate(splits))
    ranked.sort(key=lambda r: r[:2])  # stable: equal scores keep vocabulary order
    return [lr for _, _, lr in ranked]


def complete_vocab(tok: Tokenizer, vocab_size: int) -> None:
    """Fill with `<|unused_i|>` up to `vocab_size - 1` ids, then add MASK as id `vocab_size - 1`."""
    learned = tok.get_vocab_size(with_added_tokens=True)
    if learned > vocab_size - 1:
        raise AssertionError(f"trainer produced {learned} ids for a budget of {vocab_size - 1}")
    if learned < vocab_size - 1:
        logger.warning("corpus yielded %d tokenizer ids; filling %d unused ids up to vocab_size %d",
                       learned, vocab_size - 1 - learned, vocab_size)
        fillers = [AddedToken(f"<|unused_{i}|>", special=True) for i in range(vocab_size - 1 - learned)]
        tok.add_special_tokens(fillers)
    tok.add_special_tokens([AddedToken(MASK, special=True)])
    assert tok.token_to_id(MASK) == vocab_size - 1 == tok.get_vocab_size(with_added_tokens=True) - 1


def save_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike) -> None:
    """Write tokenizer.json and the transformers side files (special tokens named for PreTrainedTokenizerFast)."""
    from transformers import PreTrainedTokenizerFast

    specials = {"eos_token": EOT, "bos_token": EOT, "pad_token": EOT}
    if tok.token_to_id(MASK) is not None:
        specials["mask_token"] = MASK
    if tok.token_to_id(UNK) is not None:
        specials["unk_token"] = UNK
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def tokenizer_file(path: str | os.PathLike) -> Path:
    """`path` itself if it is a file, else `path/tokenizer.json`; hf:REPO_ID is that hub repository's file."""
    if str(path).startswith(HUB):
        return hub_tokenizer_file(str(path)[len(HUB):])
    p = Path(path)
    return p if p.is_file() else p / TOKENIZER_FILE


class HubTokenizerMissing(DataError):
    """A hub tokenizer that is neither cached nor downloadable (the data's config adds what else may be done)."""


def hub_tokenizer_file(repo_id: str) -> Path:
    """tokenizer.json of a hub repository (downloaded once, then read from the Hugging Face cache), with the
    transformers side files beside it when the repository has them."""
    from huggingface_hub import constants, hf_hub_download

    try:
        file = Path(hf_hub_download(repo_id, TOKENIZER_FILE))
    except (OSError, ValueError) as err:  # offline, not cached, no such repository or file
        raise HubTokenizerMissing(
            f"tokenizer {HUB}{repo_id}: no {TOKENIZER_FILE} in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"none downloadable ({hub_error_reason(err)}); download it once where the hub can be reached (`hf download "
            f"{repo_id} {TOKENIZER_FILE}`), or set data.tokenizer.path to a local tokenizer.json") from err
    for name in TOKENIZER_FILES[1:]:
        try:
            hf_hub_download(repo_id, name)
        except (OSError, ValueError):
            logger.info("tokenizer %s%s has no %s", HUB, repo_id, name)
    return file


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer directory, its tokenizer.json, or hf:REPO_ID."""
    file = tokenizer_file(path)
    if not file.is_file():
        raise DataError(f"no {TOKENIZER_FILE} at {path}")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise DataError(f"cannot load tokenizer {file}: {str(err).splitlines()[0]}") from err
    return TextTokenizer(tok, str(file))


def tokenizer_sha256(path: str | os.PathLike) -> str:
    """sha256 of the tokenizer.json in directory `path` (or of `path` when it is the file)."""
    return hashlib.sha256(tokenizer_file(path).read_bytes()).hexdigest()


def copy_tokenizer(src: str | os.PathLike, dst_dir: str | os.PathLike) -> None:
    """Copy a tokenizer's files (those that exist) into `dst_dir`, e.g. into an exported model directory."""
    src_file = tokenizer_file(src)
    Path(dst_dir).mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        f = src_file.parent / name if name != TOKENIZER_FILE else src_file
        if f.is_file():
            shutil.copyfile(f, Path(dst_dir) / name)
