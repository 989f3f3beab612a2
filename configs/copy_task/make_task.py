"""Writes the copy task's tokenizer directory and prompt file next to this script (seeded, so
rerunning it reproduces the committed files).

    python configs/copy_task/make_task.py

tokenizer/: a character-level tokenizer (a `tokenizers` WordLevel model over single characters,
wrapped in transformers' PreTrainedTokenizerFast and saved with save_pretrained, so
AutoTokenizer.from_pretrained reads it): <pad> <eos> <unk>, the digits, and a, b, c (16 tokens).
prompts.jsonl: 512 rows {"prompt": "<3 to 8 digits>", "answer": "<the last digit>"}.
"""

import json
import os
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = ["<pad>", "<eos>", "<unk>"] + list("0123456789abc")


def make_tokenizer(path: str) -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.save_pretrained(path)
    return tok


def make_prompts(path: str, n: int = 512, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            p = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 8)))
            f.write(json.dumps({"prompt": p, "answer": p[-1]}) + "\n")


if __name__ == "__main__":
    make_tokenizer(os.path.join(HERE, "tokenizer"))
    make_prompts(os.path.join(HERE, "prompts.jsonl"))
    print(f"wrote {HERE}/tokenizer and {HERE}/prompts.jsonl")
