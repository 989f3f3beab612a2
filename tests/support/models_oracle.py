"""Shared helpers for tests/test_models_*.py: tiny HF checkpoints and the transformers oracle.

The oracle is transformers' own LlamaForCausalLM / Qwen2ForCausalLM (or *ForSequenceClassification
for value heads) plus torch.optim.AdamW and clip_grad_norm_: nothing here calls real_py's model.
"""

from __future__ import annotations

import json
import os

import torch
import transformers

from real_py import Layout

LAYOUTS = [
    Layout(dp=1, tp=1, pp=1),
    Layout(dp=1, tp=2, pp=1),
    Layout(dp=1, tp=1, pp=2),
    Layout(dp=2, tp=2, pp=1),
    Layout(dp=1, tp=2, pp=2),
    Layout(dp=2, tp=1, pp=2),
    # Permuted ranks and axis order, as the PPO runtime places models on rank subsets.
    Layout(dp=1, tp=2, pp=2, ranks=(3, 1, 2, 0), order="pp-tp-dp"),
]

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    num_hidden_layers=3,
    max_position_embeddings=64,
)


def make_checkpoint(path, model_type="llama", tied=False, head="lm", seed=0, **over):
    """Random tiny checkpoint written by transformers itself (safetensors)."""
    torch.manual_seed(seed)
    kw = dict(TINY, tie_word_embeddings=tied, **over)
    if head == "value":
        kw["num_labels"] = 1
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cls = (
        transformers.AutoModelForCausalLM
        if head == "lm"
        else transformers.AutoModelForSequenceClassification
    )
    model = cls.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_oracle(path, head="lm"):
    cls = (
        transformers.AutoModelForCausalLM
        if head == "lm"
        else transformers.AutoModelForSequenceClassification
    )
    # Gemma 2's soft-capping runs in eager attention only (SDPA ignores it)
    with open(os.path.join(path, "config.json")) as f:
        gemma = json.load(f).get("model_type") in ("gemma2", "gemma3_text")
    return cls.from_pretrained(
        path, dtype=torch.float32, **({"attn_implementation": "eager"} if gemma else {})
    ).eval()


def fused_state(model) -> dict[str, torch.Tensor]:
    """HF parameters under real_py's fused names (q|k|v and gate|up concatenated on dim 0)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    for k, v in sd.items():
        name = k[len("model.") :] if k.startswith("model.") else k
        if ".k_proj." in k or ".v_proj." in k or ".up_proj." in k or "rotary" in k:
            continue
        if ".q_proj." in k:
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [sd[k], sd[k.replace("q_proj", "k_proj")], sd[k.replace("q_proj", "v_proj")]]
            )
        elif ".gate_proj." in k:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [sd[k], sd[k.replace("gate_proj", "up_proj")]]
            )
        elif name == "score.weight":
            out["value_head.weight"] = v
        else:
            out[name] = v
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def batch(seed=1, B=6, T=10, V=97):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([10, 7, 9, 4, 10, 6][:B])
    for b in range(B):
        tokens[b, lengths[b] :] = 0
    return tokens, lengths


def nll_loss(logprobs, lengths, total):
    """Sum of -log p over real next-token positions / total (the global token count)."""
    mask = torch.arange(logprobs.shape[1]) < (lengths - 1).unsqueeze(1)
    return -(logprobs * mask).sum() / total


def value_loss(values, lengths, targets, total):
    mask = torch.arange(values.shape[1]) < lengths.unsqueeze(1)
    return (((values - targets) ** 2) * mask).sum() / total


def oracle_train_step(model, tokens, lengths, head, lr, wd, max_norm, targets=None, eps=1e-8):
    """One AdamW step of the HF model on the whole batch; returns (loss, grad_norm)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=wd, foreach=False)
    if head == "lm":
        logits = model(tokens).logits.float()
        lp = (
            torch.log_softmax(logits[:, :-1], -1)
            .gather(-1, tokens[:, 1:].unsqueeze(-1))
            .squeeze(-1)
        )
        loss = nll_loss(lp, lengths, float((lengths - 1).sum()))
    else:
        h = model.model(tokens).last_hidden_state
        values = model.score(h).squeeze(-1)
        loss = value_loss(values, lengths, targets, float(lengths.sum()))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return loss.item(), norm.item()


def oracle_generate(model, tokens, lengths, max_new, pick=None, seeds=None):
    """Per-sequence decoding by full forward passes (no cache, no padding)."""
    out = []
    for b in range(tokens.shape[0]):
        seq = tokens[b, : lengths[b]].tolist()
        gen = torch.Generator().manual_seed(int(seeds[b])) if seeds is not None else None
        new = []
        for _ in range(max_new):
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, -1].float()
            if pick is None:
                t = int(logits.argmax())
            else:
                t = int(pick(logits.unsqueeze(0), torch.rand(1, generator=gen)))
            new.append(t)
            seq.append(t)
        out.append(new)
    return torch.tensor(out)
