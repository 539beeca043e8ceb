"""The loss scaler's step record read back: counters, history, stats and the saved state.

A mixin of :class:`~ampctl.amp.scaler.LossScaler` (like :mod:`.scaler_compat`): it holds no state
of its own and reads the scaler's ring of step records (:mod:`.records`), its base counters and
its host-side counts (``_num_updates``, ``_folded``, ``_kept``). Nothing here runs per step;
everything that reads the device on the host says so.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import records as rec

__all__ = ["StepRecord"]

# The running base of the counters: everything before the oldest row not folded in yet.
_BASE = ("skipped_total", "forward_overflows", "spikes", "consecutive_overflows")


def _stat(key: str, doc: str) -> property:
    """A read-only property: ``stats()[key]``, which **syncs**."""
    return property(lambda self: self.stats()[key], doc=f"{doc} **Syncs.**")


class StepRecord:
    """Reading the step record (see the module docstring)."""

    _t: dict[str, torch.Tensor] | None
    _init: dict[str, Any]

    def _rows(self, n: int | None = None, caller: str = "recent_records") -> torch.Tensor:
        """The newest ``n`` records (default: all kept), oldest first, on the device."""
        t = self._require_init(caller)
        n = self._kept if n is None else min(n, self._kept)
        if n == 0:
            return t["history"][:0]
        return t["history"][
            rec.ring_index(self._num_updates, n, self._history_size, t["history"].device)
        ]

    def _values(self) -> dict[str, Any]:
        """The state as host values, in the form of ``_init`` (records included). **Syncs**:
        one transfer for the scalars and counters, one for the records."""
        if self._t is None:
            vals = dict(self._init)
            vals["base"] = vals.get("base") or _base_of(vals, vals["rows"], self._check_loss)
            return vals
        t = self._t
        c = self._count_tensor()
        scalars = torch.cat(
            [t["scale"].double().reshape(1), t["growth_tracker"].double().reshape(1),
             t["hysteresis_tracker"].double().reshape(1), c[:4]]
        ).tolist()  # fmt: skip
        vals: dict[str, Any] = {
            "scale": float(scalars[0]),
            "growth_tracker": int(scalars[1]),
            "hysteresis_tracker": int(scalars[2]),
        }
        vals.update({k: int(v) for k, v in zip(_BASE, scalars[3:], strict=True)})
        rows = self._rows().cpu()
        # the counters before the kept rows, which a state made from these values starts from
        vals["rows"], vals["base"] = rows, _base_of(vals, rows, self._check_loss)
        return vals

    # ------------------------------------------------------------------ the record
    def _count_tensor(self) -> torch.Tensor:
        """``[skipped, forward overflows, spikes, overflows in a row, last skipped]`` over every
        recorded step, as a float64 device tensor: the base plus the unfolded records. No host
        read."""
        t = self._require_init("device_counters")
        rows = self._rows(self._num_updates - self._folded)
        c = rec.counts(rows, check_loss=self._check_loss)
        base = t["base"]
        if rows.shape[0]:
            last = rows[-1, rec.SKIPPED].double().reshape(1)
        else:
            last = (base[3:4] > 0).double()
        return torch.cat([base[:3] + c[:3], (c[3] + c[4] * base[3]).reshape(1), last])

    def device_counters(self) -> dict[str, torch.Tensor]:
        """The counters as 0-dim device tensors (scale, skipped_total, forward_overflows,
        spikes, consecutive_overflows, last_skipped), computed from the record (a few ops, for
        a log step). No host read."""
        t = self._require_init("device_counters")
        c = self._count_tensor()
        return {
            "scale": t["scale"],
            "skipped_total": c[0],
            "forward_overflows": c[1],
            "spikes": c[2],
            "consecutive_overflows": c[3],
            "last_skipped": c[4],
        }

    def recent_skips(self, window: int) -> torch.Tensor:
        """Number of skipped steps among the last ``window`` recorded ones (device tensor, no
        host read); at most ``history_size`` steps are remembered."""
        rows = self._rows(window, "recent_skips")
        if rows.shape[0] == 0:
            return torch.zeros((), dtype=torch.float64, device=rows.device)
        return (rows[:, rec.SKIPPED] > 0).sum().double()

    def recent_records(self, n: int) -> torch.Tensor:
        """The last ``n`` step records (at most ``history_size``), oldest first, as a ``[n, 6]``
        float32 device tensor with the columns of :data:`~ampctl.amp.records.COLUMNS`; record
        ``i`` of them belongs to update ``num_updates - len + i + 1``. No host read."""
        return self._rows(n)

    def first_loss(self) -> torch.Tensor | None:
        """The loss recorded at update 1 -- the model's before any update -- as a 0-dim float64
        device tensor, or None before it or once the records have moved past it (more than
        ``history_size`` updates, or a state loaded with fewer records than updates). No host
        read."""
        if self._t is None or self._num_updates < 1 or self._num_updates > self._kept:
            return None
        return self._rows(self._num_updates)[0, rec.LOSS].double()

    def loss_since(
        self, update: int, *, without_spikes: bool = False, applied: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum, count)`` of the finite losses recorded after update number ``update`` (at
        most ``history_size`` records back), as 0-dim float64 device tensors. ``without_spikes``:
        leave out the losses the spike rule vetoed (a skipped step whose loss was above its
        threshold: an outlier batch, not the run's course; an overflow's loss stays).
        ``applied``: a log interval's loss, over the steps that were applied only (no skipped
        step's loss: overflows and spikes are counted apart, in the skip counters); when none
        was applied, over every finite loss, so a row of skipped steps keeps the loss their
        forward passes had. No host read."""
        rows = self._rows(self._num_updates - update)
        loss = rows[:, rec.LOSS].double()
        ok = torch.isfinite(loss)
        if without_spikes:
            ok = ok & ~((rows[:, rec.SKIPPED] > 0) & (rows[:, rec.LOSS] > rows[:, rec.LOSS_THR]))
        if applied and rows.shape[0]:
            # skipped is 0 or 1: at most the least of them is "applied" when one step was, and
            # every step when none was (three ops, no host read)
            skipped = rows[:, rec.SKIPPED]
            ok = ok & (skipped <= skipped.amin())
        return torch.where(ok, loss, 0.0).sum(), ok.sum().double()

    # ------------------------------------------------------------------ observed skips
    last_step_skipped = _stat("last_skipped", "Whether the last recorded step was skipped.")
    skipped_steps = _stat(
        "skipped_total", "Total skipped steps since the start (kept across checkpoints)."
    )
    forward_overflows = _stat(
        "forward_overflows", "Skipped steps whose loss itself was not finite."
    )
    consecutive_overflows = _stat(
        "consecutive_overflows", "Skipped steps in a row up to the last one (0 after a clean step)."
    )

    def mark_applied(self) -> None:
        """The last recorded step was applied after all (the guard reran it clean and stepped the
        optimizer: a transient fault): its record now reads as a clean step, so the skipped
        count, the overflows in a row and the step's kind say what happened. The scale is the
        caller's to put back. No host read."""
        if self._num_updates == 0:
            raise ValueError("LossScaler.mark_applied: no step has been recorded yet")
        t = self._require_init("mark_applied")
        t["history"][(self._num_updates - 1) % self._history_size, rec.SKIPPED] = 0.0

    @property
    def num_updates(self) -> int:
        """Number of ``update()`` calls that recorded a step (host counter, no read)."""
        return self._num_updates

    def history(self) -> list[tuple[int, float, bool]]:
        """The last ``history_size`` records ``(update, scale used, skipped)``, oldest first.
        **Syncs.**"""
        return [(int(u), float(s), bool(k)) for u, s, k in self._history_tensor().tolist()]

    def _history_tensor(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, 3]`` float64 CPU rows ``(update, scale used, kind)`` of the kept records.
        **Syncs** (the records)."""
        rows = (
            (self._rows() if self._t is not None else self._init["rows"]).cpu()
            if rows is None
            else rows
        )
        n = rows.shape[0]
        out = torch.zeros(n, 3, dtype=torch.float64)
        if n == 0:
            return out
        out[:, 0] = torch.arange(self._num_updates - n + 1, self._num_updates + 1)
        out[:, 1] = rows[:, rec.SCALE].double()
        out[:, 2] = torch.tensor(
            [rec.kind(r, check_loss=self._check_loss) for r in rows.tolist()], dtype=torch.float64
        )
        return out

    def stats(self) -> dict[str, Any]:
        """Scale and skip counters as Python values, read in one transfer. **Syncs.**"""
        if self._t is None:
            v = self._init
            rows = v["rows"]
            last = bool(rows.shape[0] and rows[-1, rec.SKIPPED] > 0)
            scale, counts = v["scale"], {k: int(v[k]) for k in _BASE}
        else:
            read = torch.cat([self._t["scale"].double().reshape(1), self._count_tensor()]).tolist()
            scale, last = read[0], bool(read[5])
            counts = dict(zip(_BASE, (int(x) for x in read[1:5]), strict=True))
        return {
            "scale": float(scale) if self._enabled else 1.0,
            "skipped_total": counts["skipped_total"],
            "forward_overflows": counts["forward_overflows"],
            "spikes": counts["spikes"],
            "consecutive_overflows": counts["consecutive_overflows"],
            "last_skipped": last,
            "steps": self._num_updates,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys plus hysteresis, bounds, counters, the history and the records.
        **Syncs.**

        Only plain numbers and CPU tensors: loadable with ``torch.load(weights_only=True)``, and
        by a GradScaler (which reads its five keys). ``history`` is ``[n, 3]`` rows ``(update,
        scale used, kind)`` (kind 0 clean, 1 gradient overflow, 2 forward overflow, 3 spike);
        ``records`` the full ``[n, 6]`` rows (:mod:`.records`). A pure pass-through (disabled,
        ``check_finite=False``) returns ``{}``, as a disabled GradScaler.
        """
        if not self._check_finite:
            return {}
        v = self._values()
        return {
            "scale": float(v["scale"]),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(v["growth_tracker"]),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": int(v["hysteresis_tracker"]),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "enabled": self._enabled,
            "skipped_total": int(v["skipped_total"]),
            "forward_overflows": int(v["forward_overflows"]),
            "spikes": int(v["spikes"]),
            "consecutive_overflows": int(v["consecutive_overflows"]),
            "last_skipped": int(bool(v["rows"].shape[0]) and bool(v["rows"][-1, rec.SKIPPED] > 0)),
            "num_updates": self._num_updates,
            "spike_thresholds": list(self._spike),
            "history": self._history_tensor(v["rows"]),
            "records": v["rows"].clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict()``; a GradScaler state dict is accepted too (counters and
        history then start from zero), and so is one of ampctl 0.2 (``history`` without
        ``records``). Created device tensors are overwritten in place, so a held
        ``scaler._scale`` stays live. A disabled scaler ignores an empty dict (what a disabled
        GradScaler saves); a pure pass-through ignores any."""
        if not self._check_finite:
            return
        if not state_dict:
            if not self._enabled:
                return
            raise RuntimeError(
                "LossScaler.load_state_dict: the state dict is empty (saved from a disabled "
                "GradScaler?); nothing to restore."
            )
        missing = [
            k
            for k in (
                "scale",
                "growth_factor",
                "backoff_factor",
                "growth_interval",
                "_growth_tracker",
            )
            if k not in state_dict
        ]
        if missing:
            raise KeyError(f"LossScaler.load_state_dict: missing keys {missing}")
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = float(state_dict.get("min_scale", self._min_scale))
        self._max_scale = float(state_dict.get("max_scale", self._max_scale))
        hist = state_dict.get("history")
        last = (
            int(torch.as_tensor(hist).reshape(-1, 3)[-1, 0])
            if hist is not None and len(hist)
            else 0
        )
        self._num_updates = int(state_dict.get("num_updates", last))
        spike = state_dict.get("spike_thresholds")
        self._spike = (float(spike[0]), float(spike[1])) if spike else (math.inf, math.inf)
        self._init = {
            "scale": float(state_dict["scale"]) if self._enabled else 1.0,
            "growth_tracker": int(state_dict["_growth_tracker"]),
            "hysteresis_tracker": int(state_dict.get("_hysteresis_tracker", self._hysteresis)),
            **{k: int(state_dict.get(k, 0)) for k in _BASE},
            "rows": _saved_rows(state_dict),
        }
        rows = self._init["rows"][-min(self._num_updates, self._history_size) :]
        self._init["rows"] = rows = rows if self._num_updates else rows[:0]
        self._init["base"] = _base_of(self._init, rows, self._check_loss)
        old, self._t = self._t, None
        self._reset_step()
        self._last_loss = None
        if old is not None:
            new = self._lazy_init(old["vec"].device)
            keys = ("vec", "growth_tracker", "hysteresis_tracker", "history", "base")
            if all(old[k].shape == new[k].shape for k in keys):
                for k in keys:  # keep the live tensors (and their views), as GradScaler's fill_
                    old[k].copy_(new[k])
                self._t = old


def _saved_rows(state: dict[str, Any]) -> torch.Tensor:
    """The records of a saved state: ``records`` as saved, or (ampctl 0.2) rows standing for its
    ``(update, scale, kind)`` history."""
    saved = state.get("records")
    if saved is not None:
        return torch.as_tensor(saved, dtype=torch.float32).reshape(-1, len(rec.COLUMNS)).clone()
    hist = state.get("history")
    if hist is None:
        return torch.zeros(0, len(rec.COLUMNS))
    h = torch.as_tensor(hist, dtype=torch.float64).reshape(-1, 3)
    return rec.from_kinds([int(k) for k in h[:, 2].tolist()], h[:, 1].tolist(), None)


def _base_of(totals: dict[str, Any], rows: torch.Tensor, check_loss: bool) -> list[float]:
    """The base counters (before ``rows``, the kept records) of saved totals: the totals less
    what the rows count; the run of skips before them only when every row was skipped."""
    if rows.shape[0] == 0:
        return [float(totals[k]) for k in _BASE]
    c = rec.counts(rows, check_loss=check_loss).tolist()  # CPU values, read at load time
    run = totals["consecutive_overflows"] - c[3] if c[4] else 0
    return [
        totals["skipped_total"] - c[0],
        totals["forward_overflows"] - c[1],
        totals["spikes"] - c[2],
        max(run, 0),
    ]
