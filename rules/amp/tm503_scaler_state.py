"""TM503: the GradScaler's state goes into checkpoints next to the optimizer's."""

from __future__ import annotations

from typing import List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, expr, stmt
from torchmigrate.rule import Example
from torchmigrate.program.precision import APEX_AMP
from torchmigrate.program.syntax import calls_by_method, line_of, method_name, receiver
from torchmigrate.program.training import looks_like_optimizer
from torchmigrate.rules.amp.base import AmpRule
from torchmigrate.rules.amp.plan import plan, scaler_visible

KEY = '"scaler"'


def _optimizer_names(ctx) -> Set[str]:
    return {o.target for o in analysis.optimizers(ctx) if o.target}


def _is_optimizer(name: Optional[str], known: Set[str]) -> bool:
    return bool(name) and (name in known or looks_like_optimizer(name))


def _clean(ws: cst.BaseParenthesizableWhitespace) -> cst.BaseParenthesizableWhitespace:
    """`ws` without its comments: a line break and the indentation, or the spaces."""
    if isinstance(ws, cst.ParenthesizedWhitespace):
        return ws.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
    return ws


def _separator(node: cst.Dict, index: int) -> cst.BaseParenthesizableWhitespace:
    """The whitespace that separates the entries of `node` (before entry `index`, or its first)."""
    for el in reversed(node.elements[:index]):
        if isinstance(el.comma, cst.Comma):
            return _clean(el.comma.whitespace_after)
    if isinstance(node.lbrace.whitespace_after, cst.ParenthesizedWhitespace):
        return _clean(node.lbrace.whitespace_after)
    return cst.SimpleWhitespace(" ")


def _key_like(elements) -> str:
    """KEY, in single quotes when the dict's string keys all use them."""
    quotes = {el.key.quote for el in elements
              if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString) and not el.key.prefix}
    return "'scaler'" if quotes == {"'"} else KEY


class ScalerState(AmpRule):
    """
    ## What it does
    When the script has a GradScaler (its own, or one the migration creates) and saves a
    checkpoint dict holding an optimizer's state, adds `"scaler": scaler.state_dict()` next to
    it, and after `optimizer.load_state_dict(ckpt[...])` restores it with
    `if ckpt.get("scaler"): scaler.load_state_dict(ckpt["scaler"])`.

    ## Why is this bad?
    The loss scale adapts during training (it starts at 65536 and settles where gradients stop
    overflowing). Without it in the checkpoint a resumed run starts over from the initial
    scale and skips steps while it backs off again (AMP recipe, "Saving/Resuming"). The load is
    guarded: checkpoints written before the migration have no scaler entry, and one saved with
    the scaler disabled (bf16, CPU) holds an empty state that an enabled scaler refuses.

    ## Limitations
    Checkpoints built in another module, or dicts built with `dict(...)`, are not changed.
    apex's `amp.state_dict()` entries are kept under their key (TM407 points them at the scaler).
    """

    code = "TM503"
    name = "scaler-state"
    summary = "Save and restore the GradScaler state in checkpoints"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            scaler = torch.amp.GradScaler("cuda")
            ckpt = torch.load(path, map_location="cpu")
            optimizer.load_state_dict(ckpt["optimizer"])
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)
            """,
            after="""
            import torch
            scaler = torch.amp.GradScaler("cuda")
            ckpt = torch.load(path, map_location="cpu")
            optimizer.load_state_dict(ckpt["optimizer"])
            if ckpt.get("scaler"):
                scaler.load_state_dict(ckpt["scaler"])
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch}, path)
            """,
            mode="lint",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.dicts: List[cst.Dict] = []

    def visit_Dict(self, node: cst.Dict) -> None:
        self.dicts.append(node)

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        p = plan(ctx)
        if p.skip or p.scaler is None:
            return
        if p.scaler.new and p.scaler_owner is None:
            return  # no rule of this run creates it
        if ctx.options.migrating and ctx.options.amp == "off" and not p.scaler.new:
            return
        scaler = p.scaler.text
        known = _optimizer_names(ctx)
        scaler_names = {scaler} | {t for t, _ in p.existing_scalers}
        # a scaler/apex state already restored somewhere: the file handles it
        restored = False
        loads = calls_by_method(ctx).get("load_state_dict", ())
        for call, name in loads:
            owner = dotted(receiver(call))
            if owner in scaler_names or name == f"{APEX_AMP}.load_state_dict":
                restored = True
        for d in self.dicts:
            self._save(d, scaler, known, scaler_names)
        if restored:
            return
        placed: Set[Tuple[str, int]] = set()  # (checkpoint, function): two optimizers restored there, one scaler
        for call, name in loads:
            if len(call.args) != 1:
                continue
            if not _is_optimizer(dotted(receiver(call)), known):
                continue
            arg = call.args[0].value
            if not (isinstance(arg, cst.Subscript) and isinstance(arg.value, (cst.Name, cst.Attribute))):
                continue
            line = line_of(ctx, call)
            if line is None or not scaler_visible(ctx, p.scaler, call) or self._bound_later(p, line):
                continue
            ckpt = code(arg.value)
            where = (ckpt, id(ctx.enclosing(call, cst.FunctionDef) or ctx.module))
            if where in placed:
                continue
            placed.add(where)
            text = f'if {ckpt}.get({KEY}):\n    {scaler}.load_state_dict({ckpt}[{KEY}])\n'
            self.report(call, f"restore the loss scale on resume: `{scaler}.load_state_dict({ckpt}[{KEY}])` "
                              "(guarded: older checkpoints have no scaler state)",
                        edits=[insert_after(line, [stmt(text)])])

    def _bound_later(self, p, line: cst.CSTNode) -> bool:
        """The scaler is made further down the restore's own function or module (a resume block
        before `scaler = GradScaler()`): a restore there would read an unbound name (an
        UnboundLocalError on every resume from a GPU checkpoint, whose scaler state is not
        empty). Then the state is saved but not restored: a resumed run starts from the default
        loss scale, which only costs it a few skipped steps."""
        ctx, info = self.ctx, p.scaler
        if info.text.startswith("self."):
            return False
        made = [ctx.statement_of(call) for text, call in p.existing_scalers if text == info.text]
        made += [n for n in (info.after, info.before) if n is not None]
        here = ctx.position(line) or 0
        scope = ctx.scope_of(line)
        return any(m is not None and ctx.scope_of(m) is scope and (ctx.position(m) or 0) > here for m in made)

    def _save(self, d: cst.Dict, scaler: str, known: Set[str], scaler_names: Set[str]) -> None:
        ctx = self.ctx
        elements = list(d.elements)
        index = None
        for i, el in enumerate(elements):
            if not isinstance(el, cst.DictElement):
                continue
            key = el.key.evaluated_value if isinstance(el.key, cst.SimpleString) else None
            if isinstance(key, str) and ("scaler" in key.lower() or key.lower() in ("amp", "amp_state")):
                return
            value = el.value
            if isinstance(value, cst.Call) and method_name(value) == "state_dict":
                owner = dotted(receiver(value))
                if owner in scaler_names or ctx.resolve(value.func) == f"{APEX_AMP}.state_dict":
                    return
                if _is_optimizer(owner, known):
                    index = i
        if index is None or not scaler_visible(ctx, plan(ctx).scaler, d):
            return
        opt = elements[index]

        def fix(node: cst.Dict) -> cst.Dict:
            els = list(node.elements)
            anchor = els[index]
            new = cst.DictElement(
                key=expr(_key_like(els)), value=expr(f"{scaler}.state_dict()"),
                whitespace_before_colon=anchor.whitespace_before_colon,
                whitespace_after_colon=anchor.whitespace_after_colon,
                comma=anchor.comma,
            )
            if index + 1 < len(els) and isinstance(anchor.comma, cst.Comma):
                # between two entries: the new one takes the anchor's separator; a comment at the
                # end of the anchor's line stays there, comment lines below it move below the new entry
                sep = anchor.comma.whitespace_after
                if isinstance(sep, cst.ParenthesizedWhitespace):
                    els[index] = anchor.with_changes(comma=anchor.comma.with_changes(
                        whitespace_after=sep.with_changes(empty_lines=[])))
                    new = new.with_changes(comma=anchor.comma.with_changes(
                        whitespace_after=sep.with_changes(first_line=cst.TrailingWhitespace())))
            else:
                # the anchor is the last entry: the new one keeps the dict's trailing comma (or its
                # absence) and goes where the next entry would, after the separator the others use
                sep = _separator(node, index)
                comma = anchor.comma if isinstance(anchor.comma, cst.Comma) else cst.Comma()
                rbrace = node.rbrace
                closing = rbrace.whitespace_before
                if isinstance(sep, cst.ParenthesizedWhitespace) and isinstance(closing, cst.ParenthesizedWhitespace):
                    # a comment after the anchor sits before the closing brace: keep it on its line
                    sep = sep.with_changes(first_line=closing.first_line)
                    rbrace = rbrace.with_changes(whitespace_before=closing.with_changes(
                        first_line=cst.TrailingWhitespace()))
                els[index] = anchor.with_changes(comma=comma.with_changes(whitespace_after=sep))
                return node.with_changes(elements=els[:index + 1] + [new] + els[index + 1:], rbrace=rbrace)
            els.insert(index + 1, new)
            return node.with_changes(elements=els)

        self.report(opt, f"save the loss scale with the optimizer: `{KEY}: {scaler}.state_dict()`",
                    edits=[replace(d, fix)])
