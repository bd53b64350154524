"""Shell commands in the files that start a program: shell scripts, SLURM batch files, Makefiles
and the code blocks of Markdown and reStructuredText documents.

Only as much of the shell is understood as finding `python ... script.py` commands needs:
words (quotes, `$(...)`, `${...}`, backticks and backslashes kept inside the word), line
continuations, the operators that end a command (`;`, `&&`, `||`, `|`, `&`, newline),
comments, here-documents (skipped), arithmetic (`$((i + 1))`, `for ((i = 0; i < 4; i++))`, one
word each) and `for`/`while`/`until ... do ... done` nesting: each command in a loop body
knows its `Loop` (header, body, `done`), so a loop that starts ranks by hand can be replaced
as a whole. Every word keeps its offsets in the file, so a rewrite replaces exactly the words it
changes and leaves every other byte of the file as it was.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

@dataclass(frozen=True)
class Word:
    raw: str  # as written, quotes included
    start: int  # offsets in the file's text
    end: int

    @property
    def value(self) -> str:
        """The word as the shell passes it on, when that is plain text (quotes removed);
        the raw text when it is not (an unterminated quote)."""
        if not any(c in self.raw for c in "'\"\\"):
            return self.raw
        try:
            parts = shlex.split(self.raw)
        except ValueError:
            return self.raw
        return parts[0] if len(parts) == 1 else self.raw

    @property
    def opaque(self) -> bool:
        """Its value is only known when the shell (or make) runs: a variable or a command."""
        return "$" in self.raw or "`" in self.raw


@dataclass(eq=False)
class Loop:
    """A `for`/`while`/`until`/`select` loop: its header, the simple commands directly in its
    body, and its `done` (with what follows it: `done > log`, `done &`)."""

    header: List[Word]  # from the keyword to before `do`: `for i in 0 1 2 3`
    parent: Optional["Loop"] = None
    body: List["Command"] = field(default_factory=list)
    nested: bool = False  # another loop in its body
    done: List[Word] = field(default_factory=list)  # `done` and its redirections; empty: no `done`
    background: bool = False  # `done &`

    @property
    def start(self) -> int:
        return self.header[0].start

    @property
    def end(self) -> int:
        return self.done[-1].end if self.done else self.header[-1].end


@dataclass
class Command:
    """One simple command: its words, where it is, and what surrounds it."""

    words: List[Word]
    line: int  # 1-based line of the first word
    loop: Optional[Loop] = None  # the innermost loop whose body it is in
    background: bool = False  # ended by `&`
    text: str = field(default="", repr=False)  # the file's whole text, for spans

    @property
    def in_loop(self) -> bool:
        return self.loop is not None

    @property
    def start(self) -> int:
        return self.words[0].start

    @property
    def end(self) -> int:
        return self.words[-1].end

    def source(self) -> str:
        return self.text[self.start:self.end]


# keywords that start a compound command or its parts; what follows them is a command
_LEADING = {"do", "then", "else", "elif", "if", "while", "until", "!", "{", "(", "time"}
_LOOPS = {"for", "while", "until", "select"}
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
_PROMPT = {"$", "%"}  # a console prompt in a documentation code block


def commands(text: str, kind: str) -> List[Command]:
    """Every simple command of the file's shell code, in order."""
    out: List[Command] = []
    for start, end in regions(text, kind):
        out += _commands(text, start, end, kind)
    return out


def regions(text: str, kind: str) -> List[Tuple[int, int]]:
    """The (start, end) spans of the text that are shell code: all of a script or Makefile,
    the fenced code blocks of Markdown, the code-block directives and literal blocks of rst."""
    if kind in ("sh", "make"):
        return [(0, len(text))]
    if kind == "markdown":
        return list(_markdown_blocks(text))
    if kind == "rst":
        return list(_rst_blocks(text))
    return []


_SHELL_INFO = {"", "sh", "bash", "shell", "console", "zsh", "shell-session", "sh-session", "bash-session",
               "shellsession", "text", "slurm", "make", "makefile"}
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`{]*)")


def _lines(text: str) -> Iterator[Tuple[int, str]]:
    """(offset, line with its newline) for each line."""
    pos = 0
    for line in text.splitlines(keepends=True):
        yield pos, line
        pos += len(line)


def _markdown_blocks(text: str) -> Iterator[Tuple[int, int]]:
    fence: Optional[str] = None
    start = 0
    shell = False
    for pos, line in _lines(text):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                shell = m.group(2).lower() in _SHELL_INFO
                start = pos + len(line)
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip().strip(fence[0]):
            if shell:
                yield start, pos
            fence = None
    if fence is not None and shell:  # an unclosed fence runs to the end of the document
        yield start, len(text)


_RST_DIRECTIVE = re.compile(r"^(\s*)\.\. (?:code-block|code|sourcecode)::\s*(\S*)\s*$")
_RST_LITERAL = re.compile(r"^(\s*)(?!\.\.).*::\s*$")


def _rst_blocks(text: str) -> Iterator[Tuple[int, int]]:
    """Code-block directives with a shell language (or none) and `::` literal blocks: the
    indented lines after them."""
    lines = list(_lines(text))
    i = 0
    while i < len(lines):
        _, line = lines[i]
        directive = _RST_DIRECTIVE.match(line)
        literal = _RST_LITERAL.match(line) if directive is None else None
        i += 1
        if not (directive and directive.group(2).lower() in _SHELL_INFO or literal):
            continue
        indent = len((directive or literal).group(1))
        while i < len(lines) and lines[i][1].strip() and lines[i][1].lstrip().startswith(":"):
            i += 1  # directive options (:linenos:)
        block_start = lines[i][0] if i < len(lines) else len(text)
        end = block_start
        while i < len(lines):
            _, body = lines[i]
            if body.strip() and len(body) - len(body.lstrip()) <= indent:
                break
            end = lines[i][0] + len(body)
            i += 1
        if end > block_start:
            yield block_start, end


def _commands(text: str, start: int, end: int, kind: str) -> List[Command]:
    out: List[Command] = []
    words: List[Word] = []
    loops: List[Loop] = []  # the loops the next command is in, innermost last
    heredocs: List[str] = []
    i = start

    def finish(background: bool = False) -> None:
        nonlocal words
        ws = words
        words = []
        while ws and ws[0].raw in _LEADING - _LOOPS:
            ws = ws[1:]
        if ws and ws[0].raw in _PROMPT and kind in ("markdown", "rst"):
            ws = ws[1:]
        if not ws:
            return
        first = ws[0].raw
        if first in _LOOPS:
            if loops:
                loops[-1].nested = True
            loops.append(Loop(ws, loops[-1] if loops else None))
            if first == "for" or first == "select":
                return
            ws = ws[1:]  # `while CONDITION`: the condition is a command, not part of the body
            while ws and ws[0].raw in _LEADING:
                ws = ws[1:]
            if not ws:
                return
        if first == "done":
            if loops:
                loop = loops.pop()
                loop.done, loop.background = ws, background
            return
        loop = loops[-1] if loops and first not in _LOOPS else loops[-2] if len(loops) > 1 else None
        command = Command(ws, text.count("\n", 0, ws[0].start) + 1, loop, background, text)
        if loop is not None:
            loop.body.append(command)
        out.append(command)

    while i < end:
        c = text[i]
        if c in " \t\r":
            i += 1
        elif text.startswith("\\\n", i) or text.startswith("\\\r\n", i):
            i += 2 if text[i + 1] == "\n" else 3
        elif c == "\n":
            finish()
            i += 1
            if heredocs:
                i = _skip_heredocs(text, i, end, heredocs)
                heredocs = []
        elif c == "#" and not words or c == "#" and text[i - 1] in " \t":
            i = _line_end(text, i, end)
        elif text.startswith("((", i):  # arithmetic: `for ((i = 0; i < 4; i++))`, `(( n++ ))`
            j = text.find("))", i + 2, end)
            j = end if j < 0 else j + 2
            words.append(Word(text[i:j], i, j))
            i = j
        elif c in ";|&()":
            op = text[i:i + 2]
            finish(background=c == "&" and op != "&&")
            i += 2 if op in ("&&", "||", ";;") else 1
        else:
            j = _word_end(text, i, end, kind)
            word = Word(text[i:j], i, j)
            words.append(word)
            heredocs += [m.group(2) for m in _HEREDOC.finditer(word.raw)]
            i = j
    finish()
    return out


def _line_end(text: str, i: int, end: int) -> int:
    j = text.find("\n", i, end)
    return end if j < 0 else j


def _skip_heredocs(text: str, i: int, end: int, delimiters: List[str]) -> int:
    """Past the bodies of the here-documents started on the line that just ended."""
    for delimiter in delimiters:
        while i < end:
            j = _line_end(text, i, end)
            line = text[i:j].strip()
            i = j + 1
            if line == delimiter:
                break
    return min(i, end)


def _word_end(text: str, i: int, end: int, kind: str) -> int:
    """The end of the word starting at `i`: unquoted whitespace or an operator ends it."""
    depth = 0  # inside $( ... ) or ${ ... }
    while i < end:
        c = text[i]
        if c == "\\":
            if text.startswith("\\\n", i) or text.startswith("\\\r\n", i):
                return i  # a continuation ends the word
            i += 2
            continue
        if c in "'\"`":
            close = text.find(c, i + 1, end)
            if c == '"':  # skip escaped quotes
                while close > 0 and text[close - 1] == "\\":
                    close = text.find(c, close + 1, end)
            i = end if close < 0 else close + 1
            continue
        if c == "$" and text[i + 1:i + 2] in ("(", "{"):
            depth += 1
            i += 2
            continue
        if depth and c in "({":  # nested: `$((i + 1))`
            depth += 1
            i += 1
            continue
        if depth and c in ")}":
            depth -= 1
            i += 1
            continue
        if depth:
            if c == "\n" and kind != "make":
                return i
            i += 1
            continue
        if c in " \t\r\n;|()":
            return i
        if c == "&":
            if text[i - 1:i] in (">", "<") or text[i + 1:i + 2] == ">":
                i += 1  # a redirection: 2>&1, &>log
                continue
            return i
        i += 1
    return i
