"""Reward of the copy task: 1.0 when the response starts with the prompt's last digit (the data
set's "answer" field), else 0.0. Called with decoded texts: fn(prompts, responses, **row)."""


def copy_last(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    return [float(r[:1] == a) for r, a in zip(responses, answer)]
