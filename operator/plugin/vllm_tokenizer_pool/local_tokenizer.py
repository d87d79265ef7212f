"""Build a real HF fast tokenizer locally (no hub): a byte-level BPE trained on generated text.

Used by tests/engine and bench/: the same Rust/transformers code paths as a downloaded model's
tokenizer, at a chosen vocabulary size (8k for tests, 151k ~ Qwen for the benchmark). The trained
Rust tokenizer is cached as JSON, since a 151k training takes a while on 2 cores.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

SPECIALS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|image_pad|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CACHE = Path(os.environ.get("VLM_CACHE", Path.home() / ".cache" / "vlm-operator")) / "tokenizers"


def generated_text(n_words: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-language lines: many distinct words, so BPE can learn big vocabs."""
    rng = random.Random(seed)
    onsets = [*"bcdfghjklmnprstvwz", "ch", "sh", "th", "tr", "st", "pl", "qu", "gr", "kr"]
    vowels = [*"aeiouy", "ai", "ou", "ea", "ie"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ng", "x"]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    punct = ["", "", "", ",", ".", "!", "?", ";"]
    lines, line = [], []
    for _ in range(n_words):
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.1:
            word = word.capitalize()
        if rng.random() < 0.05:
            word = str(rng.randint(0, 99999))
        line.append(word + rng.choice(punct))
        if len(line) >= rng.randint(8, 24):
            lines.append(" ".join(line))
            line = []
    return lines


def _train(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Enough distinct words to fill the vocabulary with merges.
    tok.train_from_iterator(generated_text(max(200_000, vocab_size * 8)), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)]
    )
    return tok


def rust_tokenizer(vocab_size: int) -> Any:
    """The trained Rust tokenizer for ``vocab_size``, from the cache when present."""
    from tokenizers import Tokenizer

    path = _CACHE / f"bpe-{vocab_size}-v1.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = _train(vocab_size)
    _CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return tok


def build_fast_tokenizer(vocab_size: int = 8000) -> Any:
    """A ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5) with special
    tokens (bos/eos/pad + 3 additional) and a ChatML-style chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=rust_tokenizer(vocab_size),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=list(SPECIALS[3:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
