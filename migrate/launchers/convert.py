"""What a shell command that runs Python does, and its torchrun form.

`parse` reads one command (see `shell`) as `[prefix] python [flags] (script | -m module)
[args]`, where the module may be `torch.distributed.launch` or `torch.distributed.run` with its
own options before the script. `edits` turns a `torch.distributed.launch` command into the
torchrun command that starts the same processes:

- `python -m torch.distributed.launch` becomes `torchrun`; an interpreter named by a path or a
  variable (`/opt/env/bin/python`, `$PYTHON`) is kept and runs `-m torch.distributed.run`, the
  same program, so the command keeps using that environment. Interpreter flags (`-u`) are
  dropped: the launcher never passed them to the workers (it starts them as `python -u`, as
  torchrun does).
- Options get their torchrun spelling (`--nproc_per_node` -> `--nproc-per-node`); `--use_env`
  goes (torchrun always sets LOCAL_RANK and never passes `--local-rank`).
- One node (no `--nnodes` or `--nnodes=1`, no rendezvous options, the master on this host or
  unset) gets `--standalone`, which replaces `--master_addr`/`--master_port`: torchrun picks a
  free port, so two jobs on one machine no longer collide. Several nodes keep their
  `--nnodes`, `--node-rank`, `--master-addr` and `--master-port` (torchrun's static rendezvous).
- A `--local_rank`/`--local-rank` given to the script on the line goes: the old launcher
  appended its own after it, and under torchrun the script reads LOCAL_RANK.

Prefixes (`CUDA_VISIBLE_DEVICES=0,1`, `srun ...`, `nohup`), the script's arguments,
redirections and layout (continuation lines) are kept as written. `python -m
torch.distributed.run` and `torchrun` commands are torchrun already and are left alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from torchmigrate.launchers.shell import Command, Word

LAUNCH = "torch.distributed.launch"
RUN = "torch.distributed.run"
_BARE_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_PATH_PYTHON = re.compile(r"^\S*/python(\d+(\.\d+)?)?$")
_VAR_PYTHON = re.compile(r"^\$[({]?\w*py\w*[)}]?$", re.IGNORECASE)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\+?=")
# commands that run the rest of the line as a command: what may come before the interpreter
WRAPPERS = {"env", "nohup", "exec", "srun", "mpirun", "mpiexec", "nice", "numactl", "taskset", "stdbuf", "sudo",
            "timeout", "command", "time", "xvfb-run", "ionice", "chrt", "setsid", "unbuffer", "caffeinate"}
_MAKE_ASSIGN = {"=", ":=", "::=", "?=", "+=", "!="}
_MAKE_PREFIX = "@-+"

# torchrun's options (torch.distributed.run's parser; torch.distributed.launch adds --use-env),
# each spelling -> the torchrun spelling
_FLAGS = ("--standalone", "--module", "--no-python", "--run-path", "--virtual-local-rank", "--use-env")
_VALUED = ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
           "--max-restarts", "--monitor-interval", "--start-method", "--event-log-handler", "--role", "--log-dir",
           "--redirects", "--tee", "--local-ranks-filter", "--duplicate-stdout-filters",
           "--duplicate-stderr-filters", "--node-rank", "--master-addr", "--master-port", "--local-addr",
           "--logs-specs", "--numa-binding", "--signals-to-handle", "--shutdown-timeout")
CANONICAL: Dict[str, str] = {}
for _name in _FLAGS + _VALUED:
    CANONICAL[_name] = CANONICAL[_name.replace("-", "_").replace("__", "--", 1)] = _name
CANONICAL.update({"-m": "--module", "-r": "--redirects", "-t": "--tee"})
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}
LOCAL_RANK_ARGS = ("--local_rank", "--local-rank")


@dataclass
class Option:
    name: str  # torchrun's spelling
    word: int  # index of the option's word
    value: Optional[str] = None
    value_word: Optional[int] = None  # the next word, when the value is not `--opt=value`


@dataclass
class Launch:
    """A command that runs a Python script (one process, or under a launcher)."""

    command: Command
    interpreter: int  # index of the interpreter word (`python3`, `torchrun`, `$PYTHON`)
    style: str  # "launch" (torch.distributed.launch), "run" (torchrun already: left alone, read for its
    # script), "python" (one process)
    script: Optional[int] = None  # index of the script (or module name) word
    module: bool = False  # the script is a module name (`-m pkg.train`)
    launcher: Optional[int] = None  # index of the `torch.distributed.launch` word
    options: List[Option] = field(default_factory=list)
    problem: Optional[str] = None  # why the command cannot be rewritten as it is written

    @property
    def words(self) -> List[Word]:
        return self.command.words

    @property
    def script_word(self) -> Optional[Word]:
        return None if self.script is None else self.words[self.script]

    def option(self, name: str) -> Optional[Option]:
        return next((o for o in self.options if o.name == name), None)

    def args(self) -> List[Word]:
        """The script's arguments."""
        return [] if self.script is None else self.words[self.script + 1:]


def interpreter(word: Word, kind: str, first: bool) -> Optional[str]:
    """"bare" (`python3`), "kept" (a path or a variable) or "torchrun" for an interpreter word."""
    value = word.value.lstrip(_MAKE_PREFIX) if kind == "make" and first else word.value
    if _BARE_PYTHON.match(value):
        return "bare"
    if value == "torchrun" or value.endswith("/torchrun"):
        return "torchrun"
    if _PATH_PYTHON.match(value) or _VAR_PYTHON.match(word.raw.lstrip(_MAKE_PREFIX) if first else word.raw):
        return "kept"
    return None


def _find_interpreter(command: Command, kind: str) -> Optional[Tuple[int, str]]:
    """The interpreter word, after what may come before it: variable assignments, a make
    variable being defined (`TRAIN = python ...`), wrappers (`srun -N 2`, `nohup`) and their
    options."""
    words = command.words
    i = 0
    while i < len(words) and ASSIGNMENT.match(words[i].raw):
        i += 1
    if kind == "make" and i == 0 and len(words) > 2 and words[1].raw in _MAKE_ASSIGN:
        i = 2
    if i >= len(words):
        return None
    found = interpreter(words[i], kind, i == 0)
    if found:
        return i, found
    if words[i].value.rsplit("/", 1)[-1] not in WRAPPERS:
        return None
    for j in range(i + 1, len(words)):
        found = interpreter(words[j], kind, False)
        if found:
            return j, found
    return None


def parse(command: Command, kind: str) -> Optional[Launch]:
    """The command as a Python launch, or None when it runs no Python script."""
    at = _find_interpreter(command, kind)
    if at is None:
        return None
    i, how = at
    words = command.words
    if how == "torchrun":
        return _launcher(Launch(command, i, "run", launcher=i), i + 1)
    j = i + 1
    while j < len(words) and words[j].value.startswith("-"):
        flag = words[j].value
        if flag == "-m":
            if j + 1 >= len(words):
                return None
            module = words[j + 1].value
            if module == RUN:
                return _launcher(Launch(command, i, "run", launcher=j + 1), j + 2)
            if module == LAUNCH:
                return _launcher(Launch(command, i, "launch", launcher=j + 1), j + 2)
            return Launch(command, i, "python", script=j + 1, module=True)
        if flag in ("-c", "-", "--version", "-V", "-h", "--help"):
            return None
        j += 2 if flag in ("-W", "-X") else 1
    if j >= len(words):
        return None  # an interactive interpreter
    return Launch(command, i, "python", script=j)


def _launcher(launch: Launch, j: int) -> Launch:
    """Read torch.distributed.launch's (or torchrun's) options up to the script."""
    words = launch.words
    while j < len(words):
        word = words[j]
        value = word.value
        if not value.startswith("-"):
            # `$DIST_ARGS train.py`: options only the shell knows; `$SCRIPT --lr 1`: the script
            if word.opaque and any(w.value.endswith(".py") for w in words[j + 1:]):
                launch.problem = f"the launcher's options come from {word.raw}, set elsewhere"
                j += 1
                continue
            launch.script = j
            break
        name, eq, inline = value.partition("=")
        canonical = CANONICAL.get(name)
        if canonical is None:
            if word.opaque:
                launch.problem = f"the launcher's options come from {word.raw}, set elsewhere"
            else:
                launch.problem = f"{name} is not an option torchrun knows"
            # whether it takes a value is unknown: the script is the next `.py` word
            launch.script = next((k for k in range(j + 1, len(words)) if words[k].value.endswith(".py")), None)
            break
        option = Option(canonical, j)
        if canonical in _FLAGS:
            j += 1
        elif eq:
            option.value = inline
            j += 1
        elif j + 1 < len(words):
            option.value, option.value_word = words[j + 1].value, j + 1
            if words[j + 1].opaque:
                option.value = words[j + 1].raw
            j += 2
        else:
            j += 1
        launch.options.append(option)
    if launch.option("--module"):
        launch.module = True
    if launch.option("--no-python"):
        launch.problem = "it runs a program that is not Python (--no-python)"
    return launch


def standalone(launch: Launch) -> bool:
    """One node, rendezvous on this host: torchrun's `--standalone` does it all."""
    nnodes = launch.option("--nnodes")
    addr = launch.option("--master-addr")
    node_rank = launch.option("--node-rank")
    rdzv = any(o.name.startswith("--rdzv") or o.name == "--standalone" for o in launch.options)
    return ((nnodes is None or nnodes.value in ("1", "1:1")) and not rdzv
            and (addr is None or addr.value in LOCAL_HOSTS) and (node_rank is None or node_rank.value == "0"))


Edit = Tuple[int, int, str]  # (start, end, replacement) in the file's text


def edits(launch: Launch, kind: str) -> List[Edit]:
    """The edits that turn a torch.distributed.launch command into its torchrun form."""
    words = launch.words
    out: List[Edit] = []
    alone = standalone(launch)
    extra = " --standalone" if alone else ""
    interp = words[launch.interpreter]
    if interpreter(interp, kind, launch.interpreter == 0) == "bare":
        skip = len(interp.raw) - len(interp.raw.lstrip(_MAKE_PREFIX)) if kind == "make" else 0
        out.append((interp.start + skip, words[launch.launcher].end, "torchrun" + extra))
    else:
        out.append((words[launch.launcher].start, words[launch.launcher].end, RUN + extra))
    dropped = {"--use-env"} | ({"--master-addr", "--master-port"} if alone else set())
    gone: List[int] = []
    for option in launch.options:
        word = words[option.word]
        if option.name in dropped:
            gone += [option.word] + ([option.value_word] if option.value_word is not None else [])
            continue
        written = word.value.partition("=")[0]
        if written != option.name and written.startswith("--"):
            at = word.raw.find(written)
            out.append((word.start + at, word.start + at + len(written), option.name))
    gone += _local_rank_args(launch)
    out += _delete(launch.command, sorted(gone))
    return sorted(out)


def _local_rank_args(launch: Launch) -> List[int]:
    """The words of a `--local_rank N` / `--local-rank=N` given to the script."""
    words = launch.words
    out: List[int] = []
    if launch.script is None:
        return out
    i = launch.script + 1
    while i < len(words):
        if words[i].value.partition("=")[0] in LOCAL_RANK_ARGS:
            out.append(i)
            if "=" not in words[i].value and i + 1 < len(words) and not words[i + 1].value.startswith("-"):
                out.append(i + 1)
                i += 1
        i += 1
    return out


def _delete(command: Command, indexes: List[int]) -> List[Edit]:
    """Delete these words (never the first), each run of neighbours at once, so the lines
    keep their shape: a run that starts a continuation line goes with the blanks after it
    (`\\` + newline + indent stay for the next word), else with the blanks before it (a run
    alone on its line takes its line along)."""
    words, text = command.words, command.text
    out: List[Edit] = []
    runs: List[List[int]] = []
    for i in indexes:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in runs:
        first, last = run[0], run[-1]
        before = text[words[first - 1].end:words[first].start]
        after = text[words[last].end:words[last + 1].start] if last + 1 < len(words) else "\n"
        if "\n" in before and "\n" not in after:
            out.append((words[first].start, words[last + 1].start, ""))
        else:
            out.append((words[first - 1].end, words[last].end, ""))
    return out


def apply(text: str, changes: List[Edit]) -> str:
    out = []
    pos = 0
    for start, end, new in sorted(changes):
        out.append(text[pos:start])
        out.append(new)
        pos = max(pos, end)
    out.append(text[pos:])
    return "".join(out)


def one_line(text: str) -> str:
    """A command as one line: continuations joined, blanks squeezed."""
    return " ".join(re.sub(r"\\\r?\n", " ", text).split())


def new_command(launch: Launch, kind: str) -> str:
    """The command after `edits`, on one line (for messages)."""
    command = launch.command
    start, end = command.start, command.end
    local = [(s - start, e - start, t) for s, e, t in edits(launch, kind)]
    return one_line(apply(command.text[start:end], local))


def scale_hint(launch: Launch, skip: Iterable[int] = ()) -> str:
    """The torchrun command that runs a one-process command's script on N GPUs of one node
    (without the words at the indexes `skip`)."""
    script = launch.script_word
    target = f"-m {script.raw}" if launch.module and script else (script.raw if script else "")
    skip = set(_local_rank_args(launch)) | set(skip)
    args = " ".join(w.raw for i, w in enumerate(launch.words) if i in range(launch.script + 1, len(launch.words))
                    and i not in skip) if launch.script is not None else ""
    return one_line(f"torchrun --standalone --nproc-per-node=N {target} {args}")


_LAUNCH_TEXT = re.compile(r"(?:[^\s\"'=]*/)?python[\d.]*\s+(?:-[A-Za-z]+\s+)*-m\s+torch\.distributed\.launch\b")


def suggest(text: str) -> str:
    """A best-effort torchrun form of any text that runs torch.distributed.launch (a launcher
    kept in a variable, a command torchmigrate will not rewrite): for messages only."""
    out = _LAUNCH_TEXT.sub("torchrun", one_line(text))
    out = re.sub(r"\s--use[-_]env\b", "", out)
    return re.sub(r"--[a-z]+(?:_[a-z]+)+\b", lambda m: CANONICAL.get(m.group(0), m.group(0)), out)
