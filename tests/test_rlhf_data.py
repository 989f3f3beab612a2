# Checks prompt data sets (jsonl, parquet, prompt key, chat template, truncation, padding), the
# local tokenizer, decoding, user reward functions, and that bad data/tokenizer/reward configs fail
# in config.validate before any rank starts.
# A failure points to real_py/rlhf/data.py (reading, tokenizing, batch rows, make_batch),
# real_py/rlhf/rewards.py (loading and checking reward functions) or the checks in
# real_py/rlhf/config/.
"""Single process, no torch.distributed. The tokenizer is the copy task's character-level one,
built by configs/copy_task/make_task.py into a tmp dir (nothing downloaded); the expected token
ids are the tokenizer's own encode()."""

import importlib.util
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from real_py.rlhf import config as CF
from real_py.rlhf import data as D
from real_py.rlhf.rewards import FunctionReward, load_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [
    {"prompt": "123", "answer": "3", "id": 0},
    {"prompt": "98765", "answer": "5", "id": 1},
    {"prompt": "4", "answer": "4", "id": 2},
]
ACTOR = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 16,
    "num_hidden_layers": 2,
    "max_position_embeddings": 32,
}
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}=a{% endif %}"
)


def _make_task():
    spec = importlib.util.spec_from_file_location(
        "make_task", os.path.join(ROOT, "configs", "copy_task", "make_task.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    mk = _make_task()
    tok = mk.make_tokenizer(str(tmp / "tok"))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(tmp / "tok_chat"))
    tok.chat_template = None
    tok.save_pretrained(str(tmp / "tok_left"))
    conf = tmp / "tok_left" / "tokenizer_config.json"
    conf.write_text(json.dumps(dict(json.loads(conf.read_text()), padding_side="left")))
    with open(tmp / "p.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in ROWS) + "\n")
    pq.write_table(
        pa.Table.from_pylist(
            [{"question": r["prompt"], "answer": r["answer"], "id": r["id"]} for r in ROWS]
        ),
        str(tmp / "p.parquet"),
    )
    (tmp / "rew.py").write_text(
        "seen = []\n"
        "def ok(prompts, responses, answer, id):\n"
        "    seen.append((prompts, responses, answer, id))\n"
        "    return [float(r[:1] == a) for r, a in zip(responses, answer)]\n"
        "def short(prompts, responses, **row):\n    return [1.0]\n"
        "def text(prompts, responses, **row):\n    return 'good'\n"
        "def numeric_text(prompts, responses, **row):\n    return ['0.5'] * len(responses)\n"
        "def one_char(prompts, responses, **row):\n    return '5'\n"
        "def needs_solution(prompts, responses, solution):\n    return [0.0] * len(responses)\n"
        "def no_row(prompts, responses, answer):\n    return [0.0] * len(responses)\n"
        "def one_param(responses):\n    return [0.0] * len(responses)\n"
        "def fails(prompts, responses, **row):\n    return [1 / 0]\n"
        "def default_solution(prompts, responses, solution=None, **row):\n"
        "    return [0.0] * len(responses)\n"
        "NOT_CALLABLE = 3\n"
    )
    return tmp


def _cfg(env, **data):
    d = {
        "actor": ACTOR,
        "critic": ACTOR,
        "generation": {"max_new_tokens": 4},
        "data": {
            "path": str(env / "p.jsonl"),
            "tokenizer_path": str(env / "tok"),
            "batch_size": 4,
            **data,
        },
    }
    return CF.from_dict(d)


def _ids(env, text, tok="tok"):
    return D.load_tokenizer(str(env / tok))(text)["input_ids"]


def test_jsonl_and_parquet_tokenize_alike(env):
    a = D.load(_cfg(env, shuffle=False), 16)
    b = D.load(_cfg(env, path=str(env / "p.parquet"), prompt_key="question", shuffle=False), 16)
    assert len(a) == len(b) == 3
    assert torch.equal(a.prompts, b.prompts) and torch.equal(a.lengths, b.lengths)
    assert a.lengths.tolist() == [3, 5, 1] and a.prompts.shape == (3, 8)
    for i, r in enumerate(ROWS):
        assert a.prompts[i, : a.lengths[i]].tolist() == _ids(env, r["prompt"])
        assert a.prompts[i, a.lengths[i] :].eq(0).all()  # right-padded
    assert b.fields([1, 0]) == {"answer": ["5", "3"], "id": [1, 0]}
    assert b.prompt_values([2]) == ["4"]


def test_padding_side_does_not_matter(env):
    """A tokenizer saved with padding_side=left gives the same right-padded prompt batch."""
    a = D.load(_cfg(env), 16)
    b = D.load(_cfg(env, tokenizer_path=str(env / "tok_left")), 16)
    assert b.tokenizer.padding_side == "left"
    assert torch.equal(a.prompts, b.prompts) and torch.equal(a.lengths, b.lengths)


def test_chat_template(env):
    d = D.load(
        _cfg(
            env,
            tokenizer_path=str(env / "tok_chat"),
            chat_template=True,
            shuffle=False,
            max_prompt_len=12,
        ),
        16,
    )
    # "<u>" is not in the vocabulary: the template renders "<u>123=a", tokenized char by char.
    tok = d.tokenizer
    want = tok(
        tok.apply_chat_template(
            [{"role": "user", "content": "123"}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )["input_ids"]
    assert d.prompts[0, : d.lengths[0]].tolist() == want and want[-2:] == _ids(env, "=a")
    assert want[-5:-2] == _ids(env, "123") and d.lengths.tolist() == [8, 10, 6]
    # A row holding messages instead of a string is rendered the same way.
    (env / "msgs.jsonl").write_text(
        json.dumps({"prompt": [{"role": "user", "content": "123"}]}) + "\n"
    )
    m = D.load(
        _cfg(
            env,
            path=str(env / "msgs.jsonl"),
            tokenizer_path=str(env / "tok_chat"),
            chat_template=True,
            max_prompt_len=12,
        ),
        16,
    )
    assert m.prompts[0, : m.lengths[0]].tolist() == want
    with pytest.raises(ValueError, match="no chat template"):
        CF.validate(_cfg(env, chat_template=True), 4)


def test_truncation_policy(env):
    with pytest.raises(
        ValueError,
        match=r"1 of 3 prompts \(first: row 1\) exceed data.max_prompt_len=4 .*longest 5",
    ):
        D.load(_cfg(env, max_prompt_len=4), 16)
    left = D.load(_cfg(env, max_prompt_len=4, truncate="left", shuffle=False), 16)
    right = D.load(_cfg(env, max_prompt_len=4, truncate="right", shuffle=False), 16)
    assert left.prompts[1].tolist() == _ids(env, "8765") and right.prompts[1].tolist() == _ids(
        env, "9876"
    )
    assert left.truncated == right.truncated == 1


def test_make_batch_rows_and_groups(env):
    cfg = _cfg(env)
    d = D.load(cfg, 16)
    b = D.make_batch(cfg.data, 1, 16, d, seed=cfg.seed, repeat=cfg.group_size())
    idx = d.batch_indices(1, 4, 1)
    assert sorted(d.order.tolist()) == [0, 1, 2] and idx.tolist() == [
        d.order[i % 3].item() for i in (4, 5, 6, 7)
    ]
    assert torch.equal(b["prompts"], d.prompts[idx]) and torch.equal(
        b["prompt_lengths"], d.lengths[idx]
    )
    g = CF.from_dict({**CF.to_dict(cfg), "algo": "grpo", "ppo": {"group_size": 2}})
    bg = D.make_batch(g.data, 0, 16, d, seed=g.seed, repeat=g.group_size())
    assert torch.equal(bg["prompts"][0], bg["prompts"][1]) and torch.equal(
        bg["prompts"][2], bg["prompts"][3]
    )
    assert not torch.equal(bg["prompts"][0], bg["prompts"][2])
    assert len(set(bg["seeds"].tolist())) == 4


def test_decode_skips_eos(env):
    tok = D.load_tokenizer(str(env / "tok"))
    t = torch.tensor([_ids(env, "12") + _ids(env, "34") + [tok.eos_token_id, 0]])
    assert D.decode(tok, t, torch.tensor([2]), torch.tensor([5])) == (["12"], ["34"])


def test_bad_data_fails_before_ranks(env, tmp_path):
    """config.validate (run by the launcher before any rank) names the key, file or row."""
    before = (env / "p.jsonl").read_text()
    cases = [
        ({"path": str(tmp_path / "none.jsonl")}, "data.path=.*no such file"),
        ({"path": str(env / "rew.py")}, "unknown extension '.py'"),
        (
            {"prompt_key": "question"},
            r"row 0: no prompt key data.prompt_key='question'.*\['answer', 'id', 'prompt'\]",
        ),
        ({"tokenizer_path": str(tmp_path / "nodir")}, "data.tokenizer_path=.*no such directory"),
        ({"tokenizer_path": None}, "needs a tokenizer"),
        ({"truncate": "middle"}, "data.truncate='middle'"),
    ]
    for over, msg in cases:
        with pytest.raises(ValueError, match=msg):
            CF.validate(_cfg(env, **over), 4)
    small = CF.from_dict({**CF.to_dict(_cfg(env)), "actor": dict(ACTOR, vocab_size=12)})
    with pytest.raises(ValueError, match="has 16 tokens but the actor's vocab_size is 12"):
        CF.validate(small, 4)
    # Unreadable inputs are named: a non-UTF-8 file, empty / broken tokenizer directories, a chat
    # template that fails to render, an empty plan.path.
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (tmp_path / "empty_tok").mkdir()
    shutil.copytree(env / "tok", tmp_path / "broken_tok")
    (tmp_path / "broken_tok" / "tokenizer.json").write_text("{not json")
    shutil.copytree(env / "tok_chat", tmp_path / "bad_template")
    bad = "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"
    jinja = tmp_path / "bad_template" / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(bad)
    else:
        tc = json.loads((tmp_path / "bad_template" / "tokenizer_config.json").read_text())
        (tmp_path / "bad_template" / "tokenizer_config.json").write_text(
            json.dumps(tc | {"chat_template": bad})
        )
    for over, msg in [
        ({"path": str(tmp_path / "latin1.jsonl")}, r"latin1.jsonl'\: not UTF-8 text \(byte \d+"),
        ({"tokenizer_path": str(tmp_path / "empty_tok")}, "empty_tok'.*no tokenizer files in it"),
        ({"tokenizer_path": str(tmp_path / "broken_tok")}, "broken_tok'.*cannot load a tokenizer"),
        (
            {"tokenizer_path": str(tmp_path / "bad_template"), "chat_template": True},
            "row 0: the chat template of tokenizer .* failed",
        ),
    ]:
        with pytest.raises(ValueError, match=msg):
            CF.validate(_cfg(env, **over), 4)
    with pytest.raises(
        ValueError, match="config plan.path=None: expected the path of an execution-plan"
    ):
        CF.load(None, ["plan.path="]).execution_plan()
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object"):
        CF.validate(_cfg(env, path=str(tmp_path / "bad.jsonl")), 4)
    assert (env / "p.jsonl").read_text() == before


def test_token_ids_outside_vocab(env, tmp_path):
    """A tokenizer whose ids have gaps: 16 entries, but id 40 for "9" -> rejected by the id
    check."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + list("012345678abc"))}
    vocab["9"] = 40
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>"
    ).save_pretrained(str(tmp_path / "gap"))
    with pytest.raises(ValueError, match="row 1: token id 40 is outside the actor's vocab_size=16"):
        CF.validate(_cfg(env, tokenizer_path=str(tmp_path / "gap")), 4)


def test_reward_function(env):
    fr = FunctionReward(f"{env / 'rew.py'}:ok")
    d = D.load(_cfg(env, shuffle=False), 16)
    out = fr(["123", "98765"], ["3x", "4"], d.fields([0, 1]))
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 0.0]
    assert fr.fn.__globals__["seen"][-1] == (["123", "98765"], ["3x", "4"], ["3", "5"], [0, 1])
    assert load_function("os.path:join") is os.path.join
    with pytest.raises(ValueError, match=r"rew.py:short returned 1 scores for 2 responses"):
        FunctionReward(f"{env / 'rew.py'}:short")(["a", "b"], ["x", "y"], {})
    with pytest.raises(ValueError, match=r"rew.py:text returned str"):
        FunctionReward(f"{env / 'rew.py'}:text")(["a", "b"], ["x", "y"], {})
    bad = [
        ("nocolon", "expected 'path/to/file.py:function'"),
        # The signature against the data's fields, before any call.
        (
            f"{env / 'rew.py'}:needs_solution",
            r"rew.py:needs_solution: the data has no field 'solution' "
            r"\(a parameter of the function without a default; the data, data.path="
            r".*p.jsonl', prompt_key='prompt', has the fields \['answer', 'id'\]\)",
        ),
        (
            f"{env / 'rew.py'}:no_row",
            r"rew.py:no_row is called with every field of the data as a keyword .* "
            r"but has no parameter for \['id'\].*add \*\*row",
        ),
        (
            f"{env / 'rew.py'}:one_param",
            r"rew.py:one_param takes 1 positional parameter\(s\) \(responses\); "
            r"it is called as fn\(prompts, responses, \*\*row\)",
        ),
        (f"{env / 'rew.py'}:fails", r"rew.py:fails failed when called .* ZeroDivisionError"),
        # Called on two rows before launch: one score for the whole batch shows there.
        (f"{env / 'rew.py'}:short", r"rew.py:short returned 1 scores for 2 responses"),
        (f"{env / 'rew.py'}:text", "rew.py:text returned str"),
        (
            f"{env / 'rew.py'}:numeric_text",
            r"rew.py:numeric_text returned the string '0.5' as a score",
        ),
        (f"{env / 'rew.py'}:one_char", "rew.py:one_char returned str 5"),
        (f"{env / 'missing.py'}:f", "no such file"),
        (f"{env / 'rew.py'}:nope", "has no attribute 'nope'"),
        (f"{env / 'rew.py'}:NOT_CALLABLE", "is a int, not callable"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ]
    for path, msg in bad:
        with pytest.raises(ValueError, match=msg):
            CF.validate(
                CF.from_dict(
                    {**CF.to_dict(_cfg(env)), "reward": {"kind": "function", "path": path}}
                ),
                4,
            )
    with pytest.raises(ValueError, match="needs a tokenizer to decode"):
        CF.validate(
            CF.from_dict({"reward": {"kind": "function", "path": f"{env / 'rew.py'}:ok"}}), 4
        )
    # Synthetic prompts (no data.path) have no fields: a required one is named before launch.
    synth = {
        "actor": ACTOR,
        "critic": ACTOR,
        "generation": {"max_new_tokens": 4},
        "data": {"tokenizer_path": str(env / "tok"), "batch_size": 4},
    }
    with pytest.raises(
        ValueError,
        match=r"rew.py:ok: the data has no field 'answer', 'id' \(a parameter of the "
        r"function without a default; the data, no data.path: the built-in "
        r"synthetic prompts, has no fields besides the prompt\)",
    ):
        CF.validate(
            CF.from_dict(dict(synth, reward={"kind": "function", "path": f"{env / 'rew.py'}:ok"})),
            4,
        )
    for fn in ("short", "default_solution"):  # **row, or a default: nothing required
        CF.validate(
            CF.from_dict(
                dict(synth, reward={"kind": "function", "path": f"{env / 'rew.py'}:{fn}"})
            ),
            4,
        )
    CF.validate(
        CF.from_dict(
            {
                **CF.to_dict(_cfg(env)),
                "reward": {"kind": "function", "path": f"{env / 'rew.py'}:default_solution"},
            }
        ),
        4,
    )
    with pytest.raises(ValueError, match="allowed: 'model', 'rule', 'function'"):
        CF.from_dict({"reward": {"kind": "python"}})


def test_shipped_task_files_are_reproducible(tmp_path):
    """make_task.py regenerates the committed tokenizer and prompt file byte for byte."""
    mk = _make_task()
    mk.make_tokenizer(str(tmp_path / "tokenizer"))
    mk.make_prompts(str(tmp_path / "prompts.jsonl"))
    task = os.path.join(ROOT, "configs", "copy_task")
    for rel in ("prompts.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        with open(os.path.join(task, rel)) as a, open(tmp_path / rel) as b:
            assert a.read() == b.read(), rel


def test_tokenizer_defaults_to_the_actor_checkpoint(env, tmp_path):
    """Without data.tokenizer_path, an actor_path directory holding tokenizer files is used."""
    from types import SimpleNamespace as NS

    cfg = NS(data=NS(tokenizer_path=None), actor_path=str(env / "tok"))
    assert D.tokenizer_path(cfg) == str(env / "tok")
    assert D.tokenizer_path(NS(data=NS(tokenizer_path=None), actor_path=str(tmp_path))) is None
    assert D.tokenizer_path(NS(data=NS(tokenizer_path="x"), actor_path=str(env / "tok"))) == "x"
