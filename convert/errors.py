"""The one exception the converter raises for bad input: its message is the single line the CLI prints."""


class ConvertError(Exception):
    """A checkpoint the converter cannot read or convert (the message names the problem)."""
