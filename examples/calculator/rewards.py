"""The correctness reward of the worked example: `tether grpo --reward-fn rewards.py:correct`.

tether calls it as `correct(prompts, responses)` with, per episode, the first prompt's user text
("What is 23 plus 5?") and the final answer (the first turn without a tool call).
"""

import re

QUESTION = re.compile(r"What is (\d+) plus (\d+)\?")
NUMBER = re.compile(r"-?\d+")


def correct(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the answer's last number is the sum asked for, else 0.0.

    The last number, not any number: an answer that lists many numbers would otherwise be
    rewarded for covering the right one.
    """
    scores = []
    for prompt, response in zip(prompts, responses):
        a, b = map(int, QUESTION.search(prompt).groups())
        numbers = NUMBER.findall(response)
        scores.append(float(bool(numbers) and int(numbers[-1]) == a + b))
    return scores
