"""Build the tiny Llama model the vLLM end-to-end tests serve (deterministic, cached).

Run with the vLLM venv's python (it needs torch, transformers and tokenizers):

    python e2e/vllm_cpu/tiny_model.py [--cache-dir DIR]

Prints the model folder on stdout. The folder is
``<cache>/tiny-llama-<hash of this file>``; it is built in a temporary folder and
renamed into place, so an interrupted build is never reused. The cache is
``$PDO_CACHE_DIR`` or ``${XDG_CACHE_HOME:-~/.cache}/pd-orchestrator``.

The model: LlamaConfig with hidden size 128, intermediate size 128, 2 layers, 4
attention heads, 2 KV heads and head_dim 32 (vLLM's CPU attention needs 32 or
more), random weights from a fixed seed, saved as safetensors. The tokenizer is a
byte-level BPE trained with the ``tokenizers`` library on this Python's standard
library sources, saved as a PreTrainedTokenizerFast with a chat template.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 4096
CORPUS_FILES = 400
CORPUS_BYTES = 6_000_000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def cache_root() -> Path:
    """The project's cache folder (see the module docstring)."""
    explicit = os.environ.get("PDO_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pd-orchestrator"


def model_key() -> str:
    """Hash of this script: a change to it builds a new model folder."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def corpus() -> Iterator[str]:
    """Up to CORPUS_BYTES of the standard library's sources, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())[:CORPUS_FILES]
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= CORPUS_BYTES:
            return


def build_tokenizer(folder: Path) -> int:
    """Train and save the tokenizer; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return len(fast)


def build_model(folder: Path, vocab_size: int) -> None:
    """Random weights from a fixed seed, saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        # Wider than the default 0.02 so greedy outputs depend on the context
        # instead of repeating one token: token-equality checks then mean more.
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)


def ensure_model(cache: Path) -> Path:
    """The model folder, built if absent."""
    target = cache / f"tiny-llama-{model_key()}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".building-{target.name}.", dir=cache))
    try:
        vocab_size = build_tokenizer(staging)
        build_model(staging, vocab_size)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: see module doc")
    args = parser.parse_args(argv)
    folder = ensure_model(args.cache_dir or cache_root())
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
