"""Loaded (PYTHONPATH) by every process tests/test_batch_and_streams_e2e.py starts: records
what each process drew, into `$STREAMS_PROBE_DIR/draws<RANK>.json` at exit.

- `initial`: the sums of the model's parameters when the program built it, taken before DDP
  broadcasts rank 0's (at `DistributedDataParallel.__init__`, or at the optimizer in one
  process), so it shows whether the program's own seeding still agrees on every rank;
- `first_mask`: the zeros of the first dropout output of a training step."""
import atexit
import json
import os

OUT = os.environ.get("STREAMS_PROBE_DIR")

if OUT:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    record = {"initial": None, "first_mask": None}

    def sums(params):
        return [round(float(p.detach().sum()), 6) for p in params]

    ddp_init = DistributedDataParallel.__init__

    def ddp_init_probe(self, module, *args, **kwargs):
        if record["initial"] is None:
            record["initial"] = sums(module.parameters())
        ddp_init(self, module, *args, **kwargs)

    opt_init = torch.optim.Optimizer.__init__

    def opt_init_probe(self, params, *args, **kwargs):
        params = list(params)
        if record["initial"] is None:
            record["initial"] = sums(p for group in params for p in (group["params"] if isinstance(group, dict)
                                                                        else [group]))
        opt_init(self, params, *args, **kwargs)

    dropout = F.dropout

    def dropout_probe(input, p=0.5, training=True, inplace=False):
        out = dropout(input, p, training, inplace)
        if training and record["first_mask"] is None:
            record["first_mask"] = (out == 0).flatten()[:64].tolist()
        return out

    DistributedDataParallel.__init__ = ddp_init_probe
    torch.optim.Optimizer.__init__ = opt_init_probe
    F.dropout = dropout_probe

    @atexit.register
    def _dump():
        if record == {"initial": None, "first_mask": None}:
            return  # a process that trained nothing: torchrun's own agent
        with open(os.path.join(OUT, f"draws{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(record, f)
