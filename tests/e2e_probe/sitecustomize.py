"""Test-only probe for migrated scripts run under torchrun (never shipped to users).

Activated by `TM_PROBE_DIR` in a worker process (one with `RANK` set). It records, without the
script's cooperation, what the end-to-end tests assert on:
- the indices each DistributedSampler yields per epoch (to prove ranks train on disjoint shards),
- every `torch.save` call's path (to prove only one rank writes checkpoints),
- a hash of the parameters of every DDP-wrapped module at exit (identical across ranks),
- the learning rates of every optimizer at exit (identical across ranks),
- every file opened for writing under `OUT_DIR` (to prove only one rank writes files).
Writes `rank<R>.json` into `TM_PROBE_DIR` at exit.
"""

import atexit
import json
import os

if os.environ.get("TM_PROBE_DIR") and "RANK" in os.environ:
    import hashlib

    import torch
    import torch.utils.data.distributed as _dist_data
    from torch.nn.parallel import DistributedDataParallel as _DDP

    import builtins

    _record = {"rank": int(os.environ["RANK"]), "samplers": [], "saves": [], "params": [], "lrs": [], "writes": []}
    _models = []
    _optimizers = []  # strong references: a script's optimizer may be freed before exit
    _out_dir = os.path.abspath(os.environ.get("OUT_DIR", os.getcwd()))

    _orig_opt_init = torch.optim.Optimizer.__init__

    def _opt_init(self, *args, **kwargs):
        _orig_opt_init(self, *args, **kwargs)
        _optimizers.append(self)

    torch.optim.Optimizer.__init__ = _opt_init

    _orig_open = builtins.open

    def _open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
            path = os.path.abspath(os.fspath(file))
            if path.startswith(_out_dir + os.sep):
                _record["writes"].append(os.path.relpath(path, _out_dir))
        return _orig_open(file, mode, *args, **kwargs)

    builtins.open = _open

    _orig_iter = _dist_data.DistributedSampler.__iter__

    def _iter(self):
        indices = list(_orig_iter(self))
        _record["samplers"].append({"epoch": self.epoch, "shuffle": self.shuffle, "dataset_len": len(self.dataset),
                                    "total_size": self.total_size, "indices": indices})
        return iter(indices)

    _dist_data.DistributedSampler.__iter__ = _iter

    _orig_init = _DDP.__init__

    def _init(self, module, *args, **kwargs):
        _orig_init(self, module, *args, **kwargs)
        _models.append(module)

    _DDP.__init__ = _init

    _orig_save = torch.save

    def _save(obj, f, *args, **kwargs):
        _record["saves"].append(os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(type(f)))
        return _orig_save(obj, f, *args, **kwargs)

    torch.save = _save

    def _dump():
        for module in _models:
            digest = hashlib.sha256()
            for p in module.parameters():
                digest.update(p.detach().cpu().contiguous().float().numpy().tobytes())
            _record["params"].append(digest.hexdigest())
        _record["lrs"] = sorted([g["lr"] for g in opt.param_groups] for opt in _optimizers)
        path = os.path.join(os.environ["TM_PROBE_DIR"], f"rank{_record['rank']}.json")
        with _orig_open(path, "w") as handle:
            json.dump(_record, handle)

    atexit.register(_dump)
