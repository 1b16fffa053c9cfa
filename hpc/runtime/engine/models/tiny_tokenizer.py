"""The tiny models' tokenizer: byte-level BPE trained offline on the standard library's sources, with the chat
template and special tokens both the tiny LLM and the tiny video model use (hpc.runtime.engine.models.tiny builds the
models, hpc.runtime.engine.video.dit the video one)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

CHAT_TEMPLATE = (  # tools, tool calls and tool answers rendered as the big models' templates do, in brief
    "{{ bos_token }}{% if tools %}<|system|>You may call these tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] or '' }}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{% endif %}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|end|>", "<|image|>", "<|pad|>"]
VOCAB_SIZE = 4096


def _corpus(limit_bytes: int = 3_000_000) -> list[str]:
    """Text that exists offline on every machine: the Python standard library's own sources."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(lib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def train_tokenizer(out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": config["bos_token"], "eos_token": config["eos_token"], "pad_token": config["pad_token"]}))
    return tok.get_vocab_size()
