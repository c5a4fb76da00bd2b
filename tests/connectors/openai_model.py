"""A tiny chat model for vLLM's OpenAI-compatible server, written locally (no hub, no network).

The weights are `connectors.vllm.run.write_model`'s Llama (realistic random weights, so outputs
depend on the context and a wrong KV load changes them), written by vLLM's own Python. Next to
them: a word-level tokenizer over exactly the model's 1,000 ids (six special tokens, then the
words `w6` ... `w999`, split at whitespace), a chat template, and a generation config. Any text
made of those words is one token per word, and every id the model can produce decodes to a word,
so an answer fed back as the next turn's history tokenizes to the ids the model produced.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "WORDS", "write_chat_model"]

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1000  # connectors.vllm.run.LLAMA.vocab
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
WORDS = tuple(f"w{i}" for i in range(len(SPECIAL_TOKENS), VOCAB))
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} </s> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""`<|system|> ... </s> <|user|> ... </s> <|assistant|>`: each message costs its words plus two
tokens, and a conversation's prompt is the previous turn's prompt plus its answer and the new
message, as the engine's prefix cache and kvtier see it."""


def tokenizer_json() -> dict[str, Any]:
    """A `tokenizers` WordLevel tokenizer, as `Tokenizer.save` writes one."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *WORDS))}
    assert len(vocab) == VOCAB
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},  # words, spaced
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def write_chat_model(vllm_python: Path, path: Path) -> Path:
    """The model folder at `path`: weights written by `vllm_python` (it has torch and
    safetensors; kvtier's own environment need not), tokenizer and chat template by this one."""
    code = (
        "import sys; from pathlib import Path; "
        "from connectors.vllm.run import write_model; write_model(Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [str(vllm_python), "-c", code, str(path)],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path
