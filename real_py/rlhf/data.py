"""Prompt data sets from local files, tokenized with a tokenizer from a local directory.

    data = load(cfg, vocab_size)          # PromptData, or None: the built-in synthetic prompts
    idx = data.batch_indices(step, B, repeat)         # [B] data-set rows of the iteration
    data.prompts[idx], data.lengths[idx]              # [B, P] right-padded ids, [B] lengths
    data.fields(idx)                                  # the rows' other fields, as lists
    make_batch(cfg.data, step, vocab_size, data, seed=cfg.seed, repeat=cfg.group_size())
                                                      # the step's prompts, prompt_lengths, seeds

Files: `.jsonl` (one JSON object per line) or `.parquet` (pyarrow); `data.prompt_key` names the
prompt field (a string, or with `data.chat_template` a string or a list of {"role", "content"}
messages). A prompt is tokenized on its own (no padding, so the tokenizer's padding side does
not matter; the tokenizer's special tokens, e.g. BOS, are added) or, with `data.chat_template`,
rendered by the tokenizer's apply_chat_template with the generation prompt and tokenized
without adding special tokens again. Prompts longer than `data.max_prompt_len` tokens follow
`data.truncate`: "error" (default) refuses the data set, "left" keeps the last tokens (the end of
a chat prompt holds the question and the generation prompt), "right" keeps the first. The batch
is right-padded (pad id 0; the generator left-aligns prompts itself). Every check runs in
`config.validate`, before any rank starts, and raises ValueError naming the file, key or row.
"""

from __future__ import annotations

import functools
import json
import os

import torch


def read_rows(path: str) -> list[dict]:
    """The rows of a .jsonl or .parquet file as dicts."""
    if not os.path.isfile(path):
        raise ValueError(f"config data.path={path!r}: no such file")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise ValueError(
                f"config data.path={path!r}: not a readable parquet file ({type(e).__name__}: {e})"
            ) from None
    elif ext in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            lines = _utf8_lines(f, path)
            for i, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path} line {i}: not JSON ({e}); expected one object per line"
                    ) from None
                if not isinstance(row, dict):
                    raise ValueError(
                        f"{path} line {i}: expected a JSON object, got {type(row).__name__}"
                    )
                rows.append(row)
    else:
        raise ValueError(
            f"config data.path={path!r}: unknown extension {ext!r}; allowed: .jsonl, .parquet"
        )
    if not rows:
        raise ValueError(f"config data.path={path!r}: the file has no rows")
    return rows


def _utf8_lines(f, path: str) -> list[str]:
    try:
        return f.readlines()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"config data.path={path!r}: not UTF-8 text (byte {e.start}: "
            f"{e.object[e.start : e.start + 4]!r}); save the prompt file as UTF-8"
        ) from None


def load_tokenizer(path: str):
    """transformers.AutoTokenizer from a local directory (nothing is downloaded)."""
    if not os.path.isdir(path):
        raise ValueError(
            f"config data.tokenizer_path={path!r}: no such directory (only local "
            "tokenizer directories are read, e.g. one written by save_pretrained)"
        )
    from transformers import AutoTokenizer

    # A directory without tokenizer files, or with broken ones, makes transformers raise anything
    # from OSError to AttributeError or a bare Exception: name the directory instead.
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ValueError(
            f"config data.tokenizer_path={path!r}: no tokenizer files in it (expected one "
            f"of {', '.join(_TOKENIZER_FILES)}, as save_pretrained writes)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ValueError(
            f"config data.tokenizer_path={path!r}: cannot load a tokenizer "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from None
    if isinstance(tok, bool) or not callable(tok):
        raise ValueError(
            f"config data.tokenizer_path={path!r}: transformers returned {type(tok).__name__}, "
            "not a tokenizer"
        )
    return tok


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class PromptData:
    """A tokenized prompt data set: prompts [num, P] int64 right-padded, lengths [num] int64,
    rows (the file's rows), tokenizer, order [num] (seeded permutation, or arange)."""

    def __init__(
        self,
        rows: list[dict],
        tokenizer,
        *,
        prompt_key: str,
        max_prompt_len: int,
        chat_template: bool,
        truncate: str,
        vocab_size: int,
        seed: int,
        shuffle: bool,
        where: str,
    ):
        self.rows, self.tokenizer, self.prompt_key = rows, tokenizer, prompt_key
        tok = tokenizer
        if len(tok) > vocab_size:
            raise ValueError(
                f"tokenizer {tok.name_or_path!r} has {len(tok)} tokens but the actor's "
                f"vocab_size is {vocab_size}; use the actor's own tokenizer or an actor "
                f"with vocab_size >= {len(tok)}"
            )
        if chat_template and not getattr(tok, "chat_template", None):
            raise ValueError(
                f"config data.chat_template=true but tokenizer {tok.name_or_path!r} has no "
                "chat template"
            )
        ids, too_long = [], []
        for i, row in enumerate(rows):
            if prompt_key not in row:
                raise ValueError(
                    f"{where} row {i}: no prompt key data.prompt_key={prompt_key!r}; the row "
                    f"has keys {sorted(row)}"
                )
            p = row[prompt_key]
            if chat_template:
                msgs = [{"role": "user", "content": p}] if isinstance(p, str) else p
                if not (isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs)):
                    raise ValueError(
                        f"{where} row {i}: {prompt_key!r} must be a string or a list of "
                        f"{{role, content}} messages, got {type(p).__name__}"
                    )
                try:
                    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                except Exception as e:
                    raise ValueError(
                        f"{where} row {i}: the chat template of tokenizer {tok.name_or_path!r} "
                        f"failed ({type(e).__name__}: {str(e)[:200]})"
                    ) from None
                t = tok(text, add_special_tokens=False)["input_ids"]
            else:
                if not isinstance(p, str):
                    raise ValueError(
                        f"{where} row {i}: {prompt_key!r} must be a string, got "
                        f"{type(p).__name__} (set data.chat_template: true for messages)"
                    )
                t = tok(p)["input_ids"]
            if not t:
                raise ValueError(f"{where} row {i}: prompt {p!r} has no tokens")
            bad = [x for x in t if not 0 <= x < vocab_size]  # len(tok) can hide ids with gaps
            if bad:
                raise ValueError(
                    f"{where} row {i}: token id {bad[0]} is outside the actor's vocab_size="
                    f"{vocab_size}"
                )
            if len(t) > max_prompt_len:
                too_long.append((i, len(t)))
                t = t[-max_prompt_len:] if truncate == "left" else t[:max_prompt_len]
            ids.append(t)
        if too_long and truncate == "error":
            raise ValueError(
                f"{where}: {len(too_long)} of {len(rows)} prompts (first: row {too_long[0][0]}) "
                f"exceed data.max_prompt_len={max_prompt_len} tokens (longest "
                f"{max(n for _, n in too_long)}); raise data.max_prompt_len or set "
                "data.truncate: left (keep the end) or right (keep the start)"
            )
        self.truncated = len(too_long)
        self.prompts = torch.zeros(len(ids), max_prompt_len, dtype=torch.int64)
        for i, t in enumerate(ids):
            self.prompts[i, : len(t)] = torch.tensor(t)
        self.lengths = torch.tensor([len(t) for t in ids], dtype=torch.int64)
        g = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(ids), generator=g) if shuffle else torch.arange(len(ids))

    def __len__(self) -> int:
        return len(self.rows)

    def batch_indices(self, step: int, B: int, repeat: int) -> torch.Tensor:
        """[B] data-set rows of iteration `step`: B // repeat consecutive rows of the (shuffled)
        order, wrapping around, each repeated `repeat` times (GRPO groups)."""
        k = B // repeat
        return self.order[(step * k + torch.arange(k)) % len(self)].repeat_interleave(repeat)

    def fields(self, idx) -> dict[str, list]:
        """The rows' fields other than the prompt: key -> [value per row] (None where absent)."""
        keys = sorted({k for i in idx for k in self.rows[int(i)]} - {self.prompt_key})
        return {k: [self.rows[int(i)].get(k) for i in idx] for k in keys}

    def prompt_values(self, idx) -> list:
        return [self.rows[int(i)][self.prompt_key] for i in idx]


def decode(
    tokenizer,
    tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    lengths: torch.Tensor,
    *,
    prompts: bool = True,
) -> tuple[list[str] | None, list[str]]:
    """tokens [b, T], prompt_lengths, lengths [b] -> (prompt texts, or None with prompts=False;
    response texts), special tokens (e.g. the EOS that ended a response) skipped."""
    rows = list(zip(tokens.tolist(), prompt_lengths.tolist(), lengths.tolist()))
    texts = (
        [tokenizer.decode(t[:p], skip_special_tokens=True) for t, p, _ in rows] if prompts else None
    )
    return texts, [tokenizer.decode(t[p:n], skip_special_tokens=True) for t, p, n in rows]


@functools.lru_cache(maxsize=4)
def _load(
    path,
    tokenizer_path,
    prompt_key,
    max_prompt_len,
    chat_template,
    truncate,
    vocab_size,
    seed,
    shuffle,
) -> PromptData:
    return PromptData(
        read_rows(path),
        load_tokenizer(tokenizer_path),
        prompt_key=prompt_key,
        max_prompt_len=max_prompt_len,
        chat_template=chat_template,
        truncate=truncate,
        vocab_size=vocab_size,
        seed=seed,
        shuffle=shuffle,
        where=path,
    )


def tokenizer_path(cfg) -> str | None:
    """data.tokenizer_path, or the actor checkpoint's directory when it holds a tokenizer."""
    if cfg.data.tokenizer_path:
        return cfg.data.tokenizer_path
    p = cfg.actor_path
    if p and any(
        os.path.exists(os.path.join(p, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return p
    return None


def load(cfg, vocab_size: int) -> PromptData | None:
    """The configured prompt data set (cached per process), or None without data.path."""
    d = cfg.data
    if not d.path:
        return None
    tp = tokenizer_path(cfg)
    if tp is None:
        raise ValueError(
            f"config data.path={d.path!r} needs a tokenizer: set data.tokenizer_path to a "
            "local tokenizer directory (or use an actor_path that holds one)"
        )
    return _load(
        d.path,
        tp,
        d.prompt_key,
        d.max_prompt_len,
        d.chat_template,
        d.truncate,
        vocab_size,
        cfg.seed,
        d.shuffle,
    )


@functools.lru_cache(maxsize=4)
def load_tokenizer_cached(path: str):
    return load_tokenizer(path)


def tokenizer(cfg, data: PromptData | None):
    """The tokenizer used to decode samples and responses: the data set's, else the configured one
    (synthetic prompts with data.tokenizer_path), else None."""
    if data is not None:
        return data.tokenizer
    tp = tokenizer_path(cfg)
    return load_tokenizer_cached(tp) if tp else None


def make_batch(
    dc, step: int, vocab_size: int, data: PromptData | None = None, *, seed: int, repeat: int = 1
) -> dict[str, torch.Tensor]:
    """The iteration's prompts (dc: the config's data section), right-padded, with a sampling seed
    per row: rows of the prompt data set `data` or, without one, a slice of the synthetic prompt
    set drawn from `seed`. The grouped algorithms (GRPO, RLOO, REINFORCE++) repeat each prompt
    `repeat` (TrainConfig.group_size()) times."""
    B = dc.batch_size
    seeds = seed * 1_000_003 + step * B + torch.arange(B)
    if data is not None:
        idx = data.batch_indices(step, B, repeat)
        return {"prompts": data.prompts[idx], "prompt_lengths": data.lengths[idx], "seeds": seeds}
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(dc.min_prompt_len, dc.max_prompt_len + 1, (dc.num_prompts,), generator=g)
    toks = torch.randint(1, vocab_size, (dc.num_prompts, dc.max_prompt_len), generator=g)
    toks = toks * (torch.arange(dc.max_prompt_len) < lens.unsqueeze(1))
    idx = (step * (B // repeat) + torch.arange(B // repeat)) % dc.num_prompts
    idx = idx.repeat_interleave(repeat)
    return {"prompts": toks[idx], "prompt_lengths": lens[idx], "seeds": seeds}


__all__ = [
    "PromptData",
    "read_rows",
    "load_tokenizer",
    "decode",
    "load",
    "tokenizer",
    "tokenizer_path",
    "make_batch",
]
