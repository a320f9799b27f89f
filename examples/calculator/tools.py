"""The calculator tool of the worked example: `tether grpo --tools tools.py:add`.

tether builds the tool's JSON schema from the type hints and the docstring (transformers'
`get_json_schema`), so both are part of the interface the model sees.
"""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
