"""The checks of `torchmigrate verify`: plain functions over what each rank's probe recorded
(`torchmigrate.cli.verify_probe`) and what each rank printed. No torch here: the CLI process
judges the records; only the children run the user's code.

Each check returns a `Check`: pass, fail or skip (nothing to judge, e.g. no checkpoint was saved),
a one-line message a user can act on, the evidence lines and the user's `file:line` responsible.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import List, Optional

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Check:
    name: str
    title: str
    status: str
    message: str
    evidence: List[str] = field(default_factory=list)
    where: List[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Run:
    """One torchrun launch: each rank's record (None when the rank left none) and its output."""

    records: List[Optional[dict]]
    outputs: List[str]
    timed_out: bool = False
    timeout: float = 0


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _tail(text: str, n: int = 6) -> List[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


# How a rank fails in a collective when its peer has died: a consequence, not the cause.
_PEER_GONE = re.compile(r"closed by peer|reset by peer|Broken pipe|DistBackendError|remote worker", re.IGNORECASE)


def exits(run: Run) -> Check:
    """Every rank ran to its end (or was stopped by the probe) and exited 0. A rank that failed
    only because another one died (a collective lost its peer) is named as a consequence."""
    title, world = "every rank exits cleanly", len(run.records)
    crashed = [r for r, rec in enumerate(run.records) if rec and rec["status"] == "crashed"]
    tool = [r for r, (rec, out) in enumerate(zip(run.records, run.outputs))
            if (rec and rec["status"] == "probe_failed") or (rec is None and _probe_traceback(out))]
    first = [r for r in crashed if not _PEER_GONE.search(run.records[r]["error"]["message"])] or crashed
    bad, evidence, where = [], [], []
    for rank, (rec, out) in enumerate(zip(run.records, run.outputs)):
        error = (rec or {}).get("error") or {}
        at = error.get("where") or "a line outside your files"
        if rec is None:
            evidence.append(f"rank {rank} left no record: " + (
                "verify's probe failed before it could write one (a torchmigrate bug, not your script)"
                if _probe_traceback(out) else
                "it was killed from outside (out of memory?) before verify's probe could write one")
                + "; its last lines:")
            evidence += ["    " + line for line in _tail(out)]
        elif rec["status"] == "probe_failed":
            evidence.append(f"rank {rank}: verify's probe failed (a torchmigrate bug, not your script): "
                            f"{error.get('message', '?')}")
        elif rank in first:
            evidence.append(f"rank {rank} crashed at {at}: {error['message']}")
            evidence += ["    " + line for line in error["traceback"]]
            where += [error["where"]] if error.get("where") else []
        elif rec["status"] == "crashed":
            evidence.append(f"rank {rank} then failed at {at}: {error['message'][:120]}")
        elif rec["status"] == "terminated":
            why = f"was stopped at the --timeout of {run.timeout:g}s" if run.timed_out else "was killed by torchrun after another rank failed"
            evidence.append(f"rank {rank} {why}, while at {at}")
            where += [error["where"]] if run.timed_out and error.get("where") else []
        elif rec["exit_code"]:
            evidence.append(f"rank {rank} exited with status {rec['exit_code']}")
        else:
            continue
        bad.append(rank)
    if run.timed_out and not bad:
        bad, evidence = list(range(world)), [f"the run did not end within the --timeout of {run.timeout:g}s"]
    if not bad:
        stopped = {rec["status"] for rec in run.records} == {"stopped"}
        return Check("exit", title, PASS, "every rank " + ("was stopped by verify after the requested epochs"
                                                            if stopped else "exited 0"))
    if crashed:
        followed = sorted(set(bad) - set(first))
        message = f"{_ranks(first)} crashed" + (f"; then {_ranks(followed)} failed too" if followed else "")
    elif tool:
        message = f"verify's probe failed on {_ranks(tool)} (a torchmigrate bug, not your script)"
    elif run.timed_out and all(rec is None for rec in run.records):
        # The probe records where a rank is when it is stopped, unless the rank is blocked
        # inside a collective (C++ code, where Python's signal handlers never run).
        message = (f"no rank ended within {run.timeout:g}s and none could be stopped to say where it was: the ranks "
                   "hang, most likely one waits in a collective (the all-reduce of a backward pass, a barrier) that "
                   "another rank skipped")
    elif run.timed_out:
        message = f"the program did not stop within {run.timeout:g}s (no training loader ended the run; see --steps/--epochs)"
    else:
        message = f"{_ranks(bad)} did not exit cleanly"
    return Check("exit", title, FAIL, message, evidence, sorted(set(where)))


def _probe_traceback(output: str) -> bool:
    """A rank's output ends in a traceback raised inside verify's probe."""
    tail = output[output.rfind("Traceback (most recent call last)"):] if "Traceback" in output else ""
    frames = re.findall(r'File "([^"]+)", line \d+', tail)
    return bool(frames) and os.path.basename(frames[-1]) == "verify_probe.py"


def probe(run: Run, resumed: Optional[Run] = None) -> Optional[Check]:
    """The probe's own failures (a torchmigrate bug): a check of their own, first in the table,
    so they are never read as the script's fault. None when the probe worked."""
    evidence = []
    for label, launch in (("", run), ("resume run: ", resumed)):
        for rank, (rec, out) in enumerate(zip(launch.records, launch.outputs) if launch else ()):
            errors = (rec or {}).get("probe_errors") or []
            if rec is None and _probe_traceback(out):
                errors = ["failed before it could write its record: " + " | ".join(_tail(out, 3))]
            evidence += [f"{label}rank {rank}: {e.splitlines()[-1] if e.splitlines() else e}" for e in errors]
    if not evidence:
        return None
    return Check("probe", "verify's own probe worked", FAIL,
                 "torchmigrate verify failed (its probe, not your script; please report it): the checks may be incomplete",
                 evidence)


def _training(run: Run) -> dict:
    """loader -> per rank, the loader's reads during which an optimizer stepped (training epochs).
    Loaders are matched across ranks by creation site and order of creation."""
    sites: dict = {}
    for rank, rec in enumerate(run.records):
        seen: dict = {}
        for loader in (rec or {}).get("loaders", {}).values():
            reads = [it for it in loader["iterations"] if it["steps"]]
            if reads:
                key = (loader["site"], seen.setdefault(loader["site"], 0))
                seen[loader["site"]] += 1
                sites.setdefault(key, {"loader": loader, "reads": {}})["reads"][rank] = reads
    return sites


# what the runtime prints when the wrapped model got the same inputs on every rank (`_check_drift`)
_SAME_INPUTS = "got the same inputs on every rank"


def sharded(run: Run) -> Check:
    """In each epoch the ranks draw disjoint samples of a training loader (up to the padding a
    DistributedSampler adds so every rank gets as many) and, unless it drops the last samples,
    together every sample."""
    title = "training loaders are sharded"
    sites = _training(run)
    same = [line.strip() for out in run.outputs for line in out.splitlines() if _SAME_INPUTS in line][:1]
    if same:
        # the runtime compares what the wrapped model is fed on every rank: the same batches on
        # every rank, whatever loader (or hand-made batches) they came from
        return Check("sharded", title, FAIL, "every rank trained on the same inputs (the runtime's check of the "
                                             "model's inputs)", same)
    if not sites:
        return Check("sharded", title, SKIP, "no training loader seen (no optimizer step while a DataLoader was read)")
    evidence, where = [], []
    world = len(run.records)
    for (site, _), info in sites.items():
        n, reads = info["loader"]["dataset_len"], info["reads"]
        if len(reads) < 2 or info["loader"].get("replacement"):
            continue  # (a sampler drawing with replacement repeats samples across ranks by design)
        epochs = min(len(r) for r in reads.values())
        for epoch in range(epochs):
            drawn = {rank: r[epoch]["indices"] for rank, r in reads.items()}
            if any(d is None for d in drawn.values()):
                break  # an IterableDataset: the dataset itself decides what each rank reads
            padding = (-n) % world if n else 0  # a DistributedSampler repeats this many to even out
            budget = info["loader"].get("sampler_len")
            if n and budget and budget * world > n and any(len(d) > len(set(d)) for d in drawn.values()):
                # a sampler that draws more than the dataset per epoch and repeats samples within
                # each rank's share too (repeated augmentation, `len_factor=3`): samples repeat
                # across the ranks' shares by design
                padding = max(padding, budget * world - n)
            common = set.intersection(*(set(d) for d in drawn.values()))
            if len(common) > padding:
                whole = n is not None and all(len(set(d)) >= n for d in drawn.values())
                what = ("every rank iterates the whole dataset" if whole
                        else f"{_ranks(drawn)} drew {len(common)} of the same samples in epoch {epoch}")
                evidence.append(f"DataLoader created at {site}: {what} ({n} samples, sampler {info['loader']['sampler']})")
                where.append(site)
                break
            drawn_all = set().union(*map(set, drawn.values()))
            # a sampler that draws a set number of samples per epoch (`InfiniteSampler(n,
            # iterations * batch)` cut by rank): together the ranks draw that many, not the dataset
            wanted = min(n, budget * world) if n and budget else n
            if wanted and not info["loader"]["drop_last"] and len(drawn_all) < wanted:
                evidence.append(f"DataLoader created at {site}: the ranks together drew {len(drawn_all)} of "
                                f"{wanted} samples in epoch {epoch}")
                where.append(site)
                break
    if evidence:
        return Check("sharded", title, FAIL, f"{len(where)} training loader(s) not sharded correctly across ranks", evidence, where)
    judged = [s for (s, _), info in sites.items() if not info["loader"].get("replacement")]
    if not judged:
        return Check("sharded", title, SKIP, "the training loaders draw with replacement: samples repeat across ranks "
                                             "by design, so no overlap can be judged")
    return Check("sharded", title, PASS, f"each rank drew a disjoint shard of the loader at {', '.join(judged)}")


def reshuffled(run: Run) -> Check:
    """A shuffling training loader draws a new order every epoch (set_epoch is called)."""
    title = "training order changes every epoch"
    sites = _training(run)
    evidence, where, judged = [], [], []
    for (site, _), info in sites.items():
        loader, reads = info["loader"], info["reads"].get(0) or next(iter(info["reads"].values()))
        if len(reads) < 2 or reads[0]["indices"] is None or loader["shuffle"] is False:
            continue
        judged.append(site)
        same = [i for i in range(1, len(reads)) if reads[i]["indices"] == reads[i - 1]["indices"]]
        if same:
            why = (" (set_epoch is not called on its DistributedSampler)"
                   if loader["sampler"] == "DistributedSampler" else "")
            evidence.append(f"DataLoader created at {site}: epoch {same[0]} drew the same order as epoch {same[0] - 1}{why}")
            where.append(site)
    if evidence:
        return Check("reshuffled", title, FAIL, "the same sample order every epoch", evidence, where)
    if not judged:
        return Check("reshuffled", title, SKIP, "no shuffling training loader was read for two epochs")
    return Check("reshuffled", title, PASS, f"a new order every epoch from the loader at {', '.join(judged)}")


def _by_optimizer(run: Run):
    """Optimizers matched across ranks by creation order: (label, where, [record per rank])."""
    recs = [rec["optimizers"] if rec else [] for rec in run.records]
    for i in range(min(map(len, recs)) if recs else 0):
        first = recs[0][i]
        yield f"{first['name']} created at {first['where'] or '?'}", first["where"], [r[i] for r in recs]


def params_in_sync(run: Run) -> Check:
    """Every optimised model ends with the same parameters on every rank, and something keeps
    them so: a process group with DDP (or the user's own all-reduce)."""
    title = "parameters identical on all ranks"
    records = [rec for rec in run.records if rec]
    optimizers = list(_by_optimizer(run))
    if not (optimizers or records and records[0]["ddp"]) or not any(rec["steps"] for rec in records):
        return Check("params", title, SKIP, "no optimizer step ran")
    steps = [rec["steps"] for rec in records]
    if run.timed_out and len(set(steps)) > 1:
        # stopped from outside mid-run: a rank one step ahead holds other parameters, rightly
        return Check("params", title, SKIP, "the ranks were stopped at the timeout after different numbers of optimizer "
                                            f"steps ({', '.join(map(str, steps))}): parameters not compared")
    if not any(rec["process_group"] for rec in records):
        return Check("params", title, FAIL,
                     "no process group: each rank trains its own copy and nothing synchronises gradients "
                     "(the model is not wrapped in DDP)", [f"{label}: no process group when it stepped" for label, _, _ in optimizers],
                     [w for _, w, _ in optimizers if w])
    evidence, where, notes = [], [], []
    for label, site, per_rank in optimizers:
        differ = len({o["hash"] for o in per_rank}) > 1
        if differ:
            why = "" if all(o["in_ddp"] for o in per_rank) else " (its model is not wrapped in DDP, so gradients are not synchronised)"
            evidence.append(f"parameters optimised by {label} differ across ranks{why}")
            where += [site] if site else []
        elif not per_rank[0]["in_ddp"]:
            notes.append(f"{label}: model not wrapped in DDP, yet its parameters are equal on every rank")
    for i, ddp in enumerate(records[0]["ddp"]):
        hashes = {rec["ddp"][i]["hash"] for rec in records if len(rec["ddp"]) > i}
        if len(hashes) > 1:
            evidence.append(f"the DDP model wrapped at {ddp['where'] or '?'} differs across ranks")
    if evidence:
        return Check("params", title, FAIL, "parameters differ across ranks", evidence, where)
    if not records[0]["ddp"] and not any(o["in_ddp"] for _, _, per_rank in optimizers for o in per_rank) \
            and not any(rec.get("synced") for rec in records):
        return Check("params", title, FAIL,
                     "no model is wrapped in DDP: each rank trains its own copy, and the parameters agree only because "
                     "every rank does the same work on the same data (no speed-up; see the migration report's NOT DONE "
                     "lines)", notes, [w for _, w, _ in optimizers if w])
    if not optimizers:  # parameters stepped by hand: the DDP models are the trained ones
        return Check("params", title, PASS, f"{len(records[0]['ddp'])} DDP model(s), stepped without an optimizer, "
                                            "equal on every rank", notes)
    return Check("params", title, PASS, f"{len(optimizers)} optimised model(s) equal on every rank", notes)


def lrs_in_sync(run: Run) -> Check:
    """Learning rates agree across ranks; a per-rank metric fed to a scheduler breaks that."""
    title = "learning rates identical on all ranks"
    optimizers = list(_by_optimizer(run))
    if not optimizers:
        return Check("lr", title, SKIP, "no optimizer was created")
    evidence, where = [], []
    for label, site, per_rank in optimizers:
        if len({tuple(o["lrs"]) for o in per_rank}) > 1:
            values = ", ".join(f"rank {r}: {o['lrs'][0]:g}" for r, o in enumerate(per_rank))
            evidence.append(f"learning rate of {label} diverged ({values})")
            where += [site] if site else []
    plateau = _per_rank_plateau(run)
    if plateau:
        evidence.append(plateau[0])
        where.append(plateau[1])
    if evidence:
        message = ("learning rates diverged across ranks" if len(evidence) > bool(plateau)
                   else "a per-rank metric drives ReduceLROnPlateau, so learning rates can diverge across ranks")
        return Check("lr", title, FAIL, message, evidence, where)
    return Check("lr", title, PASS, "equal on every rank")


def _per_rank_plateau(run: Run):
    """The first ReduceLROnPlateau.step(metric) call that got a different value on each rank."""
    calls = [rec["plateau"] if rec else [] for rec in run.records]
    for i in range(min(map(len, calls)) if calls else 0):
        values = [c[i]["value"] for c in calls]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {v:.6g}" for r, v in enumerate(values))
            site = calls[0][i]["where"] or "?"
            return (f"ReduceLROnPlateau.step(metric) at {site} got a different metric on each rank ({shown}): "
                    "reduce it across ranks (tm.all_reduce) first", site)
    return None


def _show(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def one_writer(run: Run) -> Check:
    """Only rank 0 writes files (checkpoints, logs, csv, images)."""
    title = "only rank 0 writes files"
    evidence, where = [], []
    paths = [{w["path"] for w in rec["writes"]} if rec else set() for rec in run.records]
    for rank, rec in enumerate(run.records):
        if rank == 0 or not rec:
            continue
        for write in rec["writes"]:
            if _private_temp(write["path"]) and not any(write["path"] in other for r, other in enumerate(paths) if r != rank):
                continue  # a file of this process's own in the system's temporary folder (a library's cache)
            evidence.append(f"rank {rank} wrote {_show(write['path'])} ({write['how']} at {write['where'] or '?'})")
            where += [write["where"]] if write["where"] else []
    if evidence:
        return Check("writers", title, FAIL, f"{len(evidence)} file(s) written by ranks other than 0", evidence, sorted(set(where)))
    written = len(run.records[0]["writes"]) if run.records and run.records[0] else 0
    return Check("writers", title, PASS, f"rank 0 wrote {written} file(s), the other ranks none")


def _private_temp(path: str) -> bool:
    """`path` lies in the system's temporary folder (where libraries write per-process files:
    torch_geometric's generated modules, compile caches), outside the folder the program runs in."""
    import tempfile

    def inside(folder: str) -> bool:
        try:
            return os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == os.path.realpath(folder)
        except ValueError:  # different drives
            return False

    return inside(tempfile.gettempdir()) and not inside(os.getcwd())


def unprefixed(run: Run) -> Check:
    """Saved state dicts load into the plain model: no `module.`/`_orig_mod.` keys."""
    title = "saved state dicts have plain keys"
    saves = [s for rec in run.records if rec for s in rec["saves"]]
    if not saves:
        stopped = bool(run.records) and all(rec and rec["status"] == "stopped" for rec in run.records)
        return Check("prefixes", title, SKIP, "nothing was saved with torch.save" + (
            " before verify stopped the program: its final save was NOT reached" if stopped else ""))
    bad = [s for s in saves if s["prefixed"]]
    if not bad:
        return Check("prefixes", title, PASS, f"no module./_orig_mod. keys in {len(saves)} torch.save call(s)")
    first = {(s["path"], s["where"]): s for s in reversed(bad)}  # one line per file and call site
    evidence = [f"{_show(path)} (torch.save at {where or '?'}): keys such as {', '.join(s['prefixed'][:3])}"
                for (path, where), s in sorted(first.items(), key=lambda item: str(item[0]))]
    return Check("prefixes", title, FAIL, "a saved state dict has wrapper prefixes (save tm.unwrap(model).state_dict())",
                 evidence, sorted({s["where"] for s in bad if s["where"]}))


_NOISE = re.compile(r"warn|^\s|^\[[WIE]\s?\d|^Traceback|Error\b|^W\d{4}|^I\d{4}", re.IGNORECASE)


_WARNING = re.compile(r":\d+: \w*Warning: ")


def _lines(output: str) -> set:
    """The lines a rank printed, less warnings and tracebacks (those every rank prints by design).
    A warning's message can run over several lines (`file:12: UserWarning: Converting a tensor
    ...` then `Consider using tensor.detach() first. (Triggered internally at ...)`); they all
    belong to it, up to the source line the warnings module shows indented after it."""
    lines = set()
    in_warning = 0
    for raw in output.replace("\r", "\n").splitlines():
        if _WARNING.search(raw):
            in_warning = 10  # at most this many lines of one message
            continue
        if in_warning:
            in_warning = 0 if raw[:1].isspace() else in_warning - 1
            continue
        if raw.strip() and not _NOISE.search(raw):
            lines.add(raw.strip())
    return lines


def logs_once(run: Run) -> Check:
    """A log line (epoch loss, accuracy) is printed by one rank, not once per rank."""
    title = "log lines printed once"
    per_rank = [_lines(out) for out in run.outputs]
    if len(per_rank) < 2:
        return Check("logs", title, SKIP, "one rank only")
    counts = Counter(line for lines in per_rank for line in lines)
    repeated = sorted(line for line, n in counts.items() if n > 1)
    if not repeated:
        return Check("logs", title, PASS, "no line printed by more than one rank")
    return Check("logs", title, FAIL, f"{len(repeated)} line(s) printed by more than one rank (print or log on rank 0 only)",
                 [f"e.g. {line!r}" for line in repeated[:3]])


def resumed(first: Run, second: Run) -> Check:
    """The second run loads a file the first one wrote, and every rank exits cleanly."""
    title = "resumes from its checkpoint"
    written = {w["path"] for rec in first.records if rec for w in rec["writes"]}
    loaded = {p for rec in second.records if rec for p in rec["loads"]}
    ended = exits(second)
    if ended.status == FAIL:
        return Check("resume", title, FAIL, f"the resumed run failed: {ended.message}", ended.evidence, ended.where)
    used = sorted(written & loaded)
    if not used:
        return Check("resume", title, FAIL, "the resumed run loaded no file the first run wrote",
                     [f"loaded: {', '.join(map(_show, sorted(loaded))) or 'nothing'}"])
    return Check("resume", title, PASS, f"loaded {', '.join(map(_show, used))} and exited cleanly")


def all_checks(run: Run) -> List[Check]:
    return [exits(run), sharded(run), reshuffled(run), params_in_sync(run), lrs_in_sync(run),
            one_writer(run), unprefixed(run), logs_once(run)]
