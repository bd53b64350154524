"""Test-only probe: with TM_AMP_PROBE set, records which autocast contexts (device, dtype,
enabled) a script enters and writes them to $TM_AMP_PROBE/amp_<pid>.json at exit."""
import atexit, json, os
_dir = os.environ.get("TM_AMP_PROBE")
if _dir:
    import torch
    _seen = {}
    _enter = torch.autocast.__enter__

    def _probe_enter(self):
        key = f"{self.device}:{self.fast_dtype}:{bool(self._enabled)}"
        _seen[key] = _seen.get(key, 0) + 1
        return _enter(self)

    torch.autocast.__enter__ = _probe_enter
    atexit.register(lambda: open(os.path.join(_dir, f"amp_{os.getpid()}.json"), "w").write(json.dumps(_seen)))
