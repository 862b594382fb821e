"""The training monitor: a live altair chart of a training run (loss, mean reward, skipped
groups, tokens/s per step), with a static form for a notebook opened without a kernel."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from metaclaw.notebook.widgets.base import _esc, _Reader

#: The metrics charted per training step: (column, title).
MONITOR_METRICS = (("loss", "loss"), ("reward_mean", "mean reward"),
                   ("skipped_groups", "skipped groups"), ("tokens_per_s", "tokens/s"))

#: The most steps a chart draws; a longer run draws every k-th step and the last. Every point
#: costs altair validation and bytes sent at each update: 10,000 steps took about 12 s per
#: update and 20 s for the static chart, with the kernel busy all along.
MAX_CHART_STEPS = 500

_offline_lock = threading.Lock()


def _enable_offline_charts() -> bool:
    """Make altair's ``JupyterChart`` load its JavaScript from vl-convert instead of a CDN
    (once per process). Returns False when vl-convert-python is missing."""
    from altair import JupyterChart

    with _offline_lock:
        try:
            JupyterChart.enable_offline()
        except ImportError:
            return False
        return True


class TrainingMonitor:
    """A live chart of a training run: loss, mean reward, skipped groups and tokens/s per step.

    ``store``: a :class:`metaclaw.store.Store`; ``run_id``: the run to chart (``None``: always
    the newest run in ``training_steps``). With ``poll`` (seconds, default 1) a background
    thread reads new ``training_steps`` rows and updates the chart in place, so the cell that
    displays the monitor returns at once while training runs elsewhere; ``poll=None`` updates
    only on :meth:`update` (also usable as a trainer's step callback: :meth:`on_step`).

    Displayed, it is an altair ``JupyterChart`` widget (:attr:`widget`, JavaScript bundled
    offline by vl-convert) plus a static HTML form (SVG chart + table) for nbconvert/GitHub.
    :meth:`chart` returns the altair chart itself, :attr:`frame` the steps as a polars frame.
    """

    def __init__(self, store: Any, run_id: str | None = None, *, poll: float | None = 1.0):
        if poll is not None and poll <= 0:
            raise ValueError(f"poll must be a positive number of seconds or None, got {poll!r}")
        self.store = store
        self._released = False
        self._reader = _Reader(self, store)
        self.follow_latest = run_id is None
        self.run_id = run_id
        self.poll = poll
        self.error = ""
        self._rows: list[dict[str, Any]] = []
        self._last_id = 0
        self._lock = threading.RLock()
        self._widget: Any = None
        self._display_id: str | None = None
        self._shown_steps, self._shown_at = 0, 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.update()
        if poll is not None:
            self.start()

    # -- data ---------------------------------------------------------------------------------
    def update(self) -> int:
        """Read new ``training_steps`` rows of the run; returns how many arrived.

        When following the newest run and a newer run starts, the chart switches to it.
        """
        with self._lock:
            store = self._reader.store()
            if self.follow_latest:
                latest = store.query(
                    "SELECT run_id FROM training_steps ORDER BY id DESC LIMIT 1")
                newest = latest[0]["run_id"] if latest else None
                if newest != self.run_id:
                    self.run_id, self._rows, self._last_id = newest, [], 0
            if self.run_id is None:
                return 0
            rows = store.query(
                "SELECT id, run_id, step, created_at, backend, policy_version, skill_generation, "
                "loss, reward_mean, reward_std, groups, skipped_groups, tokens, wall_time_s "
                "FROM training_steps WHERE run_id = ? AND id > ? ORDER BY id",
                (self.run_id, self._last_id))
            for row in rows:
                wall = row.get("wall_time_s")
                row["tokens_per_s"] = (float(row["tokens"]) / wall
                                       if wall and wall > 0 and row.get("tokens") is not None
                                       else None)
                self._rows.append(row)
                self._last_id = row["id"]
            if rows and self._widget is not None:
                self._widget.chart = self.chart()
        if rows:
            self._update_display()
        return len(rows)

    def on_step(self, *_args: Any, **_kwargs: Any) -> None:
        """A step callback for a trainer: reads the newest rows at once (arguments ignored)."""
        self.update()

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The charted steps (rows of ``training_steps`` plus ``tokens_per_s``), oldest first."""
        with self._lock:
            return [dict(r) for r in self._rows]

    @property
    def frame(self):
        """The charted steps as a ``polars.DataFrame``."""
        import polars as pl

        columns = ("run_id", "step", "created_at", "policy_version", "skill_generation", "loss",
                   "reward_mean", "reward_std", "groups", "skipped_groups", "tokens",
                   "wall_time_s", "tokens_per_s")
        schema = {"run_id": pl.Utf8, "step": pl.Int64, "created_at": pl.Float64,
                  "policy_version": pl.Int64, "skill_generation": pl.Int64, "loss": pl.Float64,
                  "reward_mean": pl.Float64, "reward_std": pl.Float64, "groups": pl.Int64,
                  "skipped_groups": pl.Int64, "tokens": pl.Int64, "wall_time_s": pl.Float64,
                  "tokens_per_s": pl.Float64}
        rows = self.steps
        return pl.DataFrame({c: [r.get(c) for r in rows] for c in columns}, schema=schema)

    # -- polling ------------------------------------------------------------------------------
    def start(self, poll: float | None = None) -> "TrainingMonitor":
        """Start (or keep) the background poller; returns the monitor."""
        if poll is not None:
            self.poll = poll
        if self.poll is None:
            self.poll = 1.0
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll_loop, name="metaclaw-training-monitor",
                                        daemon=True)
        self._thread.start()
        return self

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.update()
                self.error = ""
            except Exception as exc:  # e.g. the store was closed: stop polling, say why
                self.error = f"the training monitor stopped polling: {exc}"
                return

    def stop(self) -> None:
        """Stop the background poller (the chart keeps its last data)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._thread = None
        self._update_display(force=True)

    # -- the output it was displayed in -------------------------------------------------------
    #: Seconds between two updates of the displayed output's static form (a PNG drawn each time).
    DISPLAY_EVERY_S = 2.0

    def _ipython_display_(self) -> None:
        """Displayed with a display id, so that the output's static form (the PNG a notebook
        shows without a kernel, or before it is trusted) follows the run: a saved notebook
        carries the chart as it ended, not its first, empty state."""
        import uuid

        from IPython.display import display

        if self._display_id is None:
            self._display_id = uuid.uuid4().hex
        data, metadata = self._repr_mimebundle_()
        display(data, metadata=metadata, raw=True, display_id=self._display_id)
        self._shown_steps, self._shown_at = len(self._rows), time.monotonic()

    def _update_display(self, force: bool = False) -> None:
        if self._display_id is None or len(self._rows) == self._shown_steps:
            return
        if not force and time.monotonic() - self._shown_at < self.DISPLAY_EVERY_S:
            return
        from IPython.display import update_display

        try:
            data, metadata = self._repr_mimebundle_()
            update_display(data, metadata=metadata, raw=True, display_id=self._display_id)
        except Exception:  # noqa: BLE001 - the live chart itself is already up to date
            return
        self._shown_steps, self._shown_at = len(self._rows), time.monotonic()

    @property
    def polling(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop polling and close the chart widget (its output goes blank; :meth:`stop` only
        stops polling and keeps the chart)."""
        self.stop()
        self._released = True
        self._reader.release()
        if self._widget is not None:
            self._widget.close()

    # -- chart --------------------------------------------------------------------------------
    def _title(self) -> str:
        if self.run_id is None:
            return "Training: waiting for the first step"
        rows = self._rows
        if not rows:
            return f"Training run {self.run_id}: no steps yet"
        last = rows[-1]
        bits = [f"step {last['step']}"]
        if last.get("loss") is not None:
            bits.append(f"loss {last['loss']:.4g}")
        if last.get("reward_mean") is not None:
            bits.append(f"mean reward {last['reward_mean']:.3g}")
        bits.append(f"policy v{last['policy_version']}")
        return f"Training run {self.run_id}: " + ", ".join(bits)

    def chart(self):
        """The altair chart of the run: one small panel per metric, step on the x axis."""
        import altair as alt

        with self._lock:
            stride = max(1, math.ceil(len(self._rows) / MAX_CHART_STEPS))
            rows = self._rows[::stride]
            if rows and rows[-1] is not self._rows[-1]:
                rows.append(self._rows[-1])
            # an infinite loss (a diverged step) is left out as a gap: JSON has no infinity
            values = [{"step": r["step"], "metric": title, "value": r[column]}
                      for r in rows for column, title in MONITOR_METRICS
                      if r.get(column) is not None and math.isfinite(r[column])]
            title = self._title()
            if stride > 1:
                title += f" (1 step in {stride} drawn)"
        order = [title_ for _, title_ in MONITOR_METRICS]
        base = alt.Chart(alt.Data(values=values)).mark_line(point=True).encode(
            x=alt.X("step:Q", title="step", axis=alt.Axis(tickMinStep=1)),
            y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False)),
            color=alt.Color("metric:N", legend=None, sort=order),
            tooltip=[alt.Tooltip("metric:N"), alt.Tooltip("step:Q"),
                     alt.Tooltip("value:Q", format=".4g")],
        ).properties(width=260, height=130)
        return base.facet(
            facet=alt.Facet("metric:N", title=None, sort=order), columns=2,
        ).resolve_scale(y="independent").properties(title=title)

    @property
    def widget(self):
        """The live ``altair.JupyterChart`` widget (built on first use, JavaScript offline)."""
        with self._lock:
            if self._widget is None:
                from altair import JupyterChart

                _enable_offline_charts()
                self._widget = JupyterChart(self.chart())
            return self._widget

    def _repr_mimebundle_(self, **kwargs: Any):
        """The live chart widget, and for a notebook opened without a kernel (or not trusted
        yet, where JupyterLab shows no widget) the chart as a PNG drawn locally."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle or {}, {})
        data, metadata = dict(data), dict(metadata or {})
        png = None
        if self._rows:
            from metaclaw.notebook.charts import png_bundle

            try:
                png = png_bundle(self.chart().to_dict())
            except Exception:  # noqa: BLE001 - the HTML table below still tells the story
                png = None
        if png is not None:
            data["image/png"] = png[0]["image/png"]
            metadata.update(png[1])
        else:
            data["text/html"] = self._repr_html_()
        data["text/plain"] = repr(self)
        return data, metadata

    def _repr_html_(self, limit: int = 10) -> str:
        svg = ""
        if self._rows:
            try:
                import vl_convert

                svg = vl_convert.vegalite_to_svg(self.chart().to_dict())
            except Exception:  # the table below still tells the story
                svg = ""
        rows = self.steps[-limit:]
        head = "".join(f"<th>{c}</th>" for c in ("step", "policy", "gen", "loss", "mean reward",
                                                  "skipped groups", "tokens/s"))

        def num(value: Any, fmt: str = ".4g") -> str:
            return "" if value is None else format(value, fmt)

        body = "".join(
            f"<tr><td>{r['step']}</td><td>v{r['policy_version']}</td>"
            f"<td>{r['skill_generation']}</td><td>{num(r.get('loss'))}</td>"
            f"<td>{num(r.get('reward_mean'))}</td><td>{r.get('skipped_groups')}</td>"
            f"<td>{num(r.get('tokens_per_s'), '.1f')}</td></tr>" for r in rows)
        table = (f"<table><tr>{head}</tr>{body}</table>" if rows else "<p>No steps yet.</p>")
        more = (f"<p>(last {len(rows)} of {len(self._rows)} steps)</p>"
                if len(self._rows) > len(rows) else "")
        return (f"<div class='metaclaw-training-static'><b>{_esc(self._title())}</b>"
                f"{svg}{table}{more}</div>")

    def __repr__(self) -> str:
        return f"TrainingMonitor(run_id={self.run_id!r}, steps={len(self._rows)}, " \
               f"polling={self.polling}): {self._title()}"


