"""The one error type for bad user input: the CLI prints it on one line and exits 2."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input, reported as `file: field: problem (fix)`."""

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None,
                 hint: str | None = None) -> None:
        self.message = message
        self.file = file
        self.field = field
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = ": ".join(part for part in (self.file, self.field) if part)
        text = f"{where}: {self.message}" if where else self.message
        if self.hint:
            text += f" ({self.hint})"
        return text


class UserErrors(UserError):
    """Several independent mistakes found in one validation pass."""

    def __init__(self, errors: list[UserError]) -> None:
        self.errors = errors
        super().__init__("; ".join(e.render() for e in errors))

    def render(self) -> str:  # one line per error keeps each one readable
        return "\n".join(e.render() for e in getattr(self, "errors", []))
