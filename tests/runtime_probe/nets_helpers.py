"""Imported by nets.py: a module whose top level calls tm.cleanup() (as a migration once placed it
in an imported module) and a helper that writes a file on every rank."""
import torchmigrate.runtime as tm

tm.cleanup()  # runs at import time, before the program trains: must not end the group


def write_summary(path, text):
    with open(path, "w") as f:  # every rank writes: the runtime names this line
        f.write(text)


class Meter:
    """An AverageMeter whose avg is a read-only property."""

    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, v, n=1):
        self.sum += v * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


class ResultMeter:
    """One sum per metric beside one count, updated with a result object (depth completion)."""

    def __init__(self):
        self.count, self.sum_rmse, self.sum_mae, self.label = 0.0, 0.0, 0.0, "val"

    def update(self, rmse, mae, n=1):
        self.count += n
        self.sum_rmse += n * rmse
        self.sum_mae += n * mae
