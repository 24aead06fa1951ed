"""Environments the multi-turn tests load by name (env.cls=envs_for_tests:...), for the demo model's
vocabulary (digits, '+', '=') and the chat template `TEMPLATE` (tests/test_multiturn.py)."""

import time

from hybridrl.data.envs import ToolEnv

# user and tool messages as they are, an assistant message then EOS; a tool message ends with '='
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}{{ m.content }}={% else %}{{ m.content }}{% endif %}{% endfor %}"
)


class ThreeTurns:
    """Two observations ('1+1', then '2+2'), then done after the third assistant turn with reward 1."""

    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turn += 1
        if self.turn == 3:
            return None, 1.0, True
        return [{"role": "tool", "content": f"{self.turn}+{self.turn}"}], 0.0, False


def hang() -> str:
    """Never returns in time."""
    time.sleep(30)
    return "1"


def big() -> str:
    """Returns far more than max_output_chars."""
    return "1" * 5000


def boom(x: int) -> str:
    """Raises."""
    raise RuntimeError("boom")


def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


class Faulty(ToolEnv):
    """Whatever the model writes, turn k makes SCRIPT[k]'s call: a hanging tool, a malformed call,
    a huge result, a tool that raises, a good call, then a final answer."""

    tools = [hang, big, boom, add]
    max_output_chars = 4
    SCRIPT = [
        '<tool_call>{"name": "hang", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": ',
        '<tool_call>{"name": "big", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        "5",
    ]

    def reset(self, row):
        self.turn = 0
        return super().reset(row)

    async def step(self, text):
        self.turn += 1
        return await super().step(self.SCRIPT[min(self.turn, len(self.SCRIPT)) - 1])


class Misbehaving:
    """By prompt: reset returns a string ('r1') or a list of strings ('r2'); step blocks the event loop
    ('block'), returns a NaN reward ('nan'), a malformed info ('info') or a tool message that spells the
    EOS token ('echo', then done); any other prompt: done with reward 1."""

    def reset(self, row):
        self.p = row["prompt"]
        self.turn = 0
        return {"r1": "1+1=", "r2": ["1+1="]}.get(self.p, [{"role": "user", "content": "1+1="}])

    async def step(self, text):
        self.turn += 1
        if self.p == "block":
            time.sleep(6)  # a blocking call inside async def: the event loop stops with it
        if self.p == "nan":
            return None, float("nan"), True
        if self.p == "info":
            return [{"role": "tool", "content": "1"}], 0.0, False, ["not", "a", "dict"]
        if self.p == "echo" and self.turn == 1:
            return [{"role": "tool", "content": "1<eos>2"}], 0.0, False
        return None, 1.0, True


# the vision demo's vocabulary has no '=': a tool message is its contents, as a user's is
VISION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
)


class Looks:
    """For the vision demo (data.path vision): the row's prompt and image (its '<image>' marker), then
    a tool turn that shows a 28x28 image (one image token) of the answer's colour beside a question;
    done after the second assistant turn, reward 1 if it names that colour."""

    def reset(self, row):
        self.answer = row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        if getattr(self, "shown", False):
            return None, float(text.strip() == self.answer), True
        from PIL import Image

        from hybridrl.data.tasks import cells

        self.shown = True
        seen = Image.new("RGB", (cells.CELL, cells.CELL), cells.COLOURS[self.answer])
        return (
            [{"role": "tool", "content": [{"type": "image", "image": seen}, {"type": "text", "text": "colour?"}]}],
            0.0,
            False,
        )
