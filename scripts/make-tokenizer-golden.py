#!/usr/bin/env python3
"""Writes tests/golden/tokenizer.json: token ids and chat-template renderings produced by
Hugging Face transformers' own GGUF tokenizer conversion and Jinja2 chat templating, as an
independent reference for tokenrouter's GGUF tokenizer and template code.

Needs: pip install transformers tokenizers gguf jinja2 (no PyTorch), and scripts/fetch-models.sh.
transformers imports torch in its GGUF weight reader even for metadata; the tokenizer path
never calls it, so a placeholder module stands in for it here.
"""
import json
import os
import sys
import types

import transformers  # noqa: F401  (must be imported before the placeholder is installed)
from transformers import PreTrainedTokenizerFast


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        return _Placeholder(name)

    def __call__(self, *args, **kwargs):
        return _Placeholder("call")


sys.modules["torch"] = _Placeholder("torch")
from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: E402
    convert_gguf_tokenizer,
    get_gguf_tokenizer,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
FILES = ["Qwen2.5-Coder-0.5B-Instruct.gguf", "SmolLM2-135M-Instruct-Q4_1.gguf"]
TEXTS = [
    "Hello, world!",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "  leading spaces\tand\ttabs\n\n\nnewlines   ",
    "Ünïcödé: 日本語のテキスト, emoji 🦀🚀, Ελληνικά.",
    "<|im_start|>user\nWhat's 12*34?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's fine, we've done it, you'd agree. DON'T SHOUT",
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about Rust."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three primes."},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "Two more?"},
    ],
]

out = {}
for name in FILES:
    arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(os.path.join(MODELS, name))
    backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=tokenizer_config.get("chat_template"),
        bos_token=tokenizer_config.get("bos_token"),
        eos_token=tokenizer_config.get("eos_token"),
    )
    entry = {"encode": [], "chat": []}
    for text in TEXTS:
        ids = backend.encode(text, add_special_tokens=bool(tokenizer_config.get("add_bos_token"))).ids
        entry["encode"].append({"text": text, "ids": ids, "decoded": backend.decode(ids, skip_special_tokens=False)})
    for messages in CHATS:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        entry["chat"].append({"messages": messages, "rendered": rendered})
    out[name] = entry
    print(name, "ok", file=sys.stderr)

with open(os.path.join(ROOT, "tests", "golden", "tokenizer.json"), "w") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
