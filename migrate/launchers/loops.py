"""Ranks started by hand in a loop, and the one torchrun command that starts the same processes.

    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python train.py --local_rank $i & done; wait
    for ((r = 0; r < $N; r++)); do RANK=$r WORLD_SIZE=$N MASTER_ADDR=localhost python train.py & done

each start N copies of the script on this node and give each its rank by hand. torchrun does
exactly that (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each, and
the migrated program takes its GPU from LOCAL_RANK), so the loop becomes
`torchrun --standalone --nproc-per-node=N train.py`, followed by ` &` unless a `wait` right
after the loop is replaced with it.

`plan` rewrites only a loop whose meaning is plain, and otherwise says why not (the caller
reports the loop with the torchrun command to use):

- a `for` loop, not nested, over `0 1 ... N-1` written out (also `{0..3}`, `$(seq 0 3)`) or
  `((v = 0; v < N; v++))` with N a number or a variable the file sets before the loop;
- its body is one command, ended by `&`, that runs a Python script;
- the loop variable is the rank: given as `RANK=`, `LOCAL_RANK=` or `--local_rank` (the
  evidence that these are the ranks of one job, not N independent runs), and appears nowhere
  but there and in `CUDA_VISIBLE_DEVICES=` (torchrun's processes pick their GPU by local rank);
- `WORLD_SIZE=` is the count, `MASTER_ADDR=` this host (another host means several nodes).

What goes: those variables, `--local_rank`, the interpreter's flags (torchrun starts its
workers unbuffered). What stays, as written: other variables (`OMP_NUM_THREADS=1`), wrappers
(`nohup`), the script's other arguments and redirections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Sequence, Union

from torchmigrate.launchers import convert
from torchmigrate.launchers.convert import LOCAL_HOSTS, LOCAL_RANK_ARGS, RUN, Launch
from torchmigrate.launchers.shell import Command, Loop, Word

# variables torchrun sets for each process: given by hand in the loop, they go
_RANK_VARS = {"RANK", "LOCAL_RANK"}
_TORCHRUN_VARS = _RANK_VARS | {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                               "CUDA_VISIBLE_DEVICES"}
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ARITH_FOR = re.compile(rf"^\(\(\s*({_NAME})\s*=\s*0\s*;\s*\1\s*(<=?)\s*(\$?\{{?({_NAME}|\d+)\}}?)\s*;"
                        rf"\s*(?:\1\s*\+\+|\+\+\s*\1|\1\s*\+=\s*1|\1\s*=\s*\1\s*\+\s*1)\s*\)\)$")
_BRACES = re.compile(r"^\{0\.\.(\d+)\}$")
_SEQ = re.compile(r"^(?:\$\(|`)\s*seq\s+0\s+(\d+)\s*(?:\)|`)$")
_DECLARE = {"export", "readonly", "declare", "typeset", "local"}


@dataclass
class Plan:
    """Replace `text[start:end]` (the loop, and the `wait` after it) with `command`."""

    start: int
    end: int
    command: str
    count: str  # "4" or "$N"
    local_rank: bool  # the loop passed --local_rank: the script must read LOCAL_RANK instead


def plan(launch: Launch, kind: str, commands: Sequence[Command]) -> Union[Plan, str]:
    """The torchrun command for the loop around `launch` (a one-process command), or why there is
    none that surely starts the same processes."""
    command = launch.command
    loop = command.loop
    if loop is None or loop.parent is not None or loop.nested:
        return "it is inside a loop within a loop"
    earlier = [c for c in commands if c.end <= loop.start]
    var, count = _counted(loop, kind, earlier)
    if count is None:
        return var
    if loop.body != [command] or not command.background:
        return "the loop does more than start one background process per iteration"
    if not loop.done or len(loop.done) > 1:
        return "the loop's output is redirected" if loop.done else "the loop has no `done`"
    ref = {"$$" + var, f"$${{{var}}}"} if kind == "make" else {f"${var}", f"${{{var}}}"}
    words = launch.words
    kept: List[str] = []
    ranked = local_rank = False
    first = _first_command(words)
    for i, word in enumerate(words[:launch.interpreter]):
        name, _, value = word.raw.partition("=")
        if i < first and name in _TORCHRUN_VARS:
            value = Word(value, 0, 0).value
            if name in _RANK_VARS | {"CUDA_VISIBLE_DEVICES"} and value not in ref:
                return f"{name} is set to {value}, not to the loop's ${var}"
            if name == "WORLD_SIZE" and value.replace("{", "").replace("}", "") != count:
                return f"WORLD_SIZE is {value}, not the {count} processes the loop starts"
            if name == "MASTER_ADDR" and value not in LOCAL_HOSTS:
                return f"MASTER_ADDR is {value}: ranks on another host need a multi-node torchrun"
            ranked = ranked or name in _RANK_VARS
            continue
        if _mentions(word, var):
            return f"{word.raw} depends on the loop's ${var}"
        kept.append(word.raw)
    script = launch.script_word
    if script is None:
        return "the script it runs is not on the line"
    args: List[str] = []
    j = launch.script + 1
    while j < len(words):
        word = words[j]
        flag, eq, value = word.value.partition("=")
        if flag in LOCAL_RANK_ARGS:
            if not eq:
                j += 1
                value = words[j].value if j < len(words) else ""
            if value not in ref:
                return f"{flag} is {value}, not the loop's ${var}"
            ranked = local_rank = True
        elif _mentions(word, var):
            given = " ".join(args[-1:] + [word.raw]) if args and _takes(args[-1]) else word.raw
            return f"{given} depends on the loop's ${var}: torchrun gives every process the same arguments"
        else:
            args.append(word.raw)
        j += 1
    if not ranked:
        return f"${var} is not given as a rank (RANK, LOCAL_RANK or --local_rank): these may be independent runs"
    interp = words[launch.interpreter]
    how = convert.interpreter(interp, kind, launch.interpreter == 0)
    runner = ("torchrun" if how == "bare" else f"{interp.raw} -m {RUN}") + f" --standalone --nproc-per-node={count}"
    target = f"-m {script.raw}" if launch.module else script.raw
    end, waits = _wait_after(loop, commands, earlier)
    line = " ".join([*kept, runner, target, *args]) + ("" if waits and not loop.background else " &")
    return Plan(loop.start, end, line, count, local_rank)


def _first_command(words: List[Word]) -> int:
    """The index of the first word that is not a variable assignment."""
    i = 0
    while i < len(words) and convert.ASSIGNMENT.match(words[i].raw):
        i += 1
    return i


def _counted(loop: Loop, kind: str, earlier: Sequence[Command]):
    """(loop variable, the number of iterations as torchrun's --nproc-per-node) or (why not, None)."""
    header = [w.raw for w in loop.header]
    if header[0] != "for":
        return f"a {header[0]} loop: torchmigrate cannot count its iterations", None
    if len(header) == 2 and header[1].startswith("(("):
        m = _ARITH_FOR.match(header[1])
        if m is None:
            return f"`for {header[1]}` does not count from 0 up by one", None
        var, op, bound, name = m.group(1), m.group(2), m.group(3), m.group(4)
        if name.isdigit():
            return var, str(int(name) + (op == "<="))
        if op == "<=" or kind == "make":
            return f"the loop runs up to {bound}", None
        if not _assigned(name, earlier):
            return f"${name} is not set in this file before the loop", None
        return var, f"${name}"
    if len(header) < 4 or header[2] != "in":
        return "the loop's values are not written out", None
    var, items = header[1], header[3:]
    m = _BRACES.match(items[0]) or _SEQ.match(items[0]) if len(items) == 1 else None
    if m is not None:
        return var, str(int(m.group(1)) + 1)
    if [w for w in items if not w.isdigit()]:
        return f"the loop's values ({' '.join(items)}) are not all numbers", None
    if sorted(int(w) for w in items) != list(range(len(items))):
        return f"the loop's values ({' '.join(items)}) are not 0 to {len(items) - 1}", None
    return var, str(len(items))


def _assigned(name: str, earlier: Sequence[Command]) -> bool:
    """Whether a command before the loop sets the variable (`N=4`, `export N=$(nproc)`)."""
    for command in earlier:
        words = [w.raw for w in command.words]
        if words[0] in _DECLARE:
            words = words[1:]
        if all(convert.ASSIGNMENT.match(w) for w in words) and any(w.partition("=")[0] == name for w in words):
            return True
    return False


def _mentions(word: Word, var: str) -> bool:
    """`$i`, `${i}`, `${gpus[$i]}`, `$((i + 1))`."""
    return re.search(rf"\$\{{?{var}\b|\b{var}\b.*\)\)", word.raw) is not None


def _wait_after(loop: Loop, commands: Sequence[Command], earlier: Sequence[Command]):
    """(end of the span to replace, whether it takes a `wait` along): a bare `wait` right after
    the loop goes with it when nothing else started in the background before is still running."""
    after = next((c for c in commands if c.start >= loop.end), None)
    text = after.text if after is not None else ""
    plain = after is not None and [w.raw for w in after.words] == ["wait"] and after.loop is None \
        and not after.background and re.fullmatch(r"[ \t]*[;\n][\s;]*", text[loop.end:after.start]) is not None
    if plain and not _still_running(earlier):
        return after.end, True
    return loop.end, False


def _still_running(earlier: Sequence[Command]) -> bool:
    """Whether a command before the loop was started in the background and not waited for."""
    running = False
    for command in earlier:
        if command.words[0].raw == "wait" and command.loop is None:
            running = False
        running = running or command.background
    return running


def hint(launch: Launch) -> str:
    """The torchrun command to use instead of the loop, for a loop `plan` cannot rewrite: without
    the arguments that depend on the loop variable (torchrun gives each process the same)."""
    header = launch.command.loop.header if launch.command.loop else []
    found = _ARITH_FOR.match(header[1].raw) if len(header) == 2 else None
    var = found.group(1) if found else header[1].raw if len(header) > 2 and header[0].raw == "for" else None
    skip = [i for i, w in enumerate(launch.words) if var and _mentions(w, var)]
    skip += [i - 1 for i in skip if i and _takes(launch.words[i - 1].raw)]  # `> log.$i`, `--seed $i`
    return convert.scale_hint(launch, skip)


def _takes(word: str) -> bool:
    """Whether the word takes the next one as its value: a redirection (`2>`) or an option."""
    return re.fullmatch(r"\d*[<>]+|--?[A-Za-z][\w-]*", word) is not None
