"""Helpers shared by tests in tests/step/ only (what other folders share is in tests/helpers.py)."""
from __future__ import annotations

from megatrain_nb.host.optim import DeviceAdamW
from megatrain_nb.step.late_moments import LateMoments


def slow_nan(monkeypatch) -> list:
    """Every upload sleeps first; a group arrives with NaN moments until its upload writes them. Returns
    the list of (group, whether its upload had finished) at each wait for it."""
    monkeypatch.setattr(LateMoments, "delay", 0.05)
    add = DeviceAdamW.add

    def nan_add(self, units, upload=None, moments=True):
        r = add(self, units, upload, moments)
        if not moments:
            r.exp_avg.fill_(float("nan"))
            r.exp_avg_sq.fill_(float("nan"))
        return r

    monkeypatch.setattr(DeviceAdamW, "add", nan_add)
    seen = []
    wait = LateMoments.wait

    def spy(self, g, stream):
        if g in self.pending:
            seen.append((g, self.pending[g].done))
        return wait(self, g, stream)

    monkeypatch.setattr(LateMoments, "wait", spy)
    return seen
