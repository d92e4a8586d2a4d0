"""Regenerate the built-in model's byte-level BPE tokenizer (run once; output committed).

    python engine/assets/train_tokenizer.py

The corpus is a few paragraphs written for this purpose plus every printable ASCII
character, so any text round-trips (byte-level BPE never needs an unknown token).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = """
A gateway sits in front of a model and decides who is served next. Every tenant calls it
with a key, and every key belongs to a tier: priority, interactive or batch. The queue is
fair between tenants of one tier and honest with those it cannot serve in time: it says
"not now" and tells them when to come back.
The engine keeps a paged cache of keys and values. Each block holds sixteen tokens; a
sequence owns a list of blocks, and sequences that share a prompt prefix share its blocks.
When memory runs short, the engine preempts the request that is cheapest to recompute and
puts it back at the head of its queue. Long prompts are split into chunks so that short
requests arriving meanwhile get their first token quickly.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
Once upon a time there was a small model with random weights. It spoke only noise, but it
spoke quickly, and it never needed the network. People used it to test the plumbing:
requests in, tokens out, errors typed, nothing lost, nothing leaked.
def generate(prompt, max_tokens=16, temperature=0.0): return engine.step()
for i in range(10): print(i, i * i, "hello world")
{"model": "tiny-random", "messages": [{"role": "user", "content": "Hello!"}]}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 42 -7 1e-6
Café, naïve, résumé, Straße, 日本語, 中文, русский, العربية, emoji 🙂🚀
""".strip()


def main() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
    )
    printable = "".join(chr(c) for c in range(32, 127))
    tokenizer.train_from_iterator([CORPUS] * 4 + [printable], trainer=trainer)
    tokenizer.save(str(HERE / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|end_of_text|>",
        "add_bos_token": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
