"""Word-level tokenizer for the QA task, built with HF `tokenizers` and saved for `AutoTokenizer`.

Owns the vocabulary order and special tokens: `<pad>`=0, `<s>`=1 (BOS, prepended by default),
`</s>`=2, `<unk>`=3, then `qa.task.vocabulary()`. Splits on whitespace only, so encoding two
strings separately and concatenating the ids equals encoding them joined by a space; decoding
joins words with single spaces. Knows nothing about models or training.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from qa.task import END, vocabulary

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The task tokenizer (deterministic: the vocabulary is fixed by qa.task)."""
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *vocabulary()])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD
    )


def save_tokenizer(directory: str | Path) -> None:
    build_tokenizer().save_pretrained(str(directory))


def load_tokenizer(directory: str | Path):
    return AutoTokenizer.from_pretrained(str(directory))


def end_token_id(tokenizer) -> int:
    """Id of the answer terminator '.'."""
    return tokenizer.convert_tokens_to_ids(END)
