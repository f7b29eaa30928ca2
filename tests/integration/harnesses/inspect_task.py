"""A small inspect task for `inspect eval ... --model mockllm/model --sandbox dsec`: the solver runs commands and
writes a file in the sample's sandbox, the scorer reads it back from there."""

import itertools

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import Generate, TaskState, generate, solver
from inspect_ai.util import sandbox


@solver
def compute_in_sandbox():  # type: ignore[no-untyped-def]
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        result = await sandbox().exec(["python3", "-c", f"print({state.input})"])
        await sandbox().write_file("answer.txt", result.stdout.strip())
        return state

    return solve


@scorer(metrics=[accuracy()])
def answer_file():  # type: ignore[no-untyped-def]
    async def score(state: TaskState, target: Target) -> Score:
        answer = await sandbox().read_file("answer.txt")
        return Score(value=CORRECT if answer == target.text else INCORRECT, answer=answer)

    return score


def mock_model():  # type: ignore[no-untyped-def]
    """inspect's mockllm; its outputs carry their token usage, so it never downloads a tokenizer to count it."""
    output = ModelOutput.from_content("mockllm/model", "let me compute that in the sandbox")
    output.usage = ModelUsage(input_tokens=8, output_tokens=8, total_tokens=16)
    return get_model("mockllm/model", custom_outputs=itertools.repeat(output))


@task
def arithmetic() -> Task:
    return Task(dataset=[Sample(input="6 * 7", target="42"), Sample(input="2 ** 10", target="1024")],
                solver=[generate(), compute_in_sandbox()], scorer=answer_file(), sandbox="dsec", model=mock_model())
