"""The error a file's processing reports to the user, in a module that imports nothing, so
the file handling and the lint cache can raise and catch it without importing the engine (and
LibCST, which takes a third of a second to import)."""


class InputError(Exception):
    """Bad input for one file: reported as `path:line:col: message`, exit code 2."""

    def __init__(self, message: str, line: int = 1, col: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.col = col
