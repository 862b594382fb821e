"""Notebook widgets: the skill diff, the support/query buffers, the trace, the training monitor
and the scheduler view, one module each (``skill_diff``, ``buffers``, ``trace``, ``training``,
``scheduler``, mirroring ``widgets/*.js``) on a shared ``base``.

Each widget is an `anywidget <https://anywidget.dev>`_ class holding only synced traitlets and
its front-end module (``widgets/*.js`` after the shared ``widgets/common.js``, and
``widgets/metaclaw.css``, shipped in the package as ``metaclaw/_widgets``); all drawing happens
in the front-end, so the widgets work in JupyterLab, VS Code and Colab alike. Python recomputes the data when a synced choice changes
(``old`` / ``new`` of the diff, the buffer filters, the selected turn), so the state can be driven
and tested from plain Python without a browser.

Every widget also has a static HTML form (``_repr_html_``, included in its MIME bundle next to
the widget view) so nbconvert and GitHub show the tables and diffs when no widget runtime is
there.

    SkillDiffWidget(library, old=None, new=None, mode="unified")
    BufferWidget(store, set_filter="all", state_filter="all", generation=None, text="")
    TraceWidget(store, session=None)
    TrainingMonitor(store, run_id=None, poll=1.0)     # live altair chart (JupyterChart)
    SchedulerView(scheduler_or_status_fn, store=None)

May import: the shared modules, the wings whose objects the widgets show (the skill library, the
fast loop's gate, labels and proposals, the slow loop's scheduler), :mod:`metaclaw.trace` and
:mod:`metaclaw.notebook.charts`. Never the magics or the command line: the magics create the
widgets (checked by ``tests/test_architecture.py``).
"""


from metaclaw.notebook.widgets.base import (MAX_TEXT_CHARS, WIDGETS_DIR, SourceGone, esm,
                                            release_store, turn_previews)
from metaclaw.notebook.widgets.buffers import BufferWidget
from metaclaw.notebook.widgets.scheduler import SchedulerView, plain_unavailable, state_segments
from metaclaw.notebook.widgets.skill_diff import (SkillDiffWidget, diff_html, diff_payload,
                                                  generation_label)
from metaclaw.notebook.widgets.trace import TraceWidget, _trace_turn_html
from metaclaw.notebook.widgets.training import MAX_CHART_STEPS, MONITOR_METRICS, TrainingMonitor

__all__ = ["SkillDiffWidget", "BufferWidget", "TraceWidget", "TrainingMonitor", "SchedulerView",
           "diff_payload", "diff_html", "generation_label", "turn_previews", "state_segments",
           "plain_unavailable", "release_store", "SourceGone", "esm", "WIDGETS_DIR",
           "MONITOR_METRICS", "MAX_CHART_STEPS", "MAX_TEXT_CHARS", "_trace_turn_html"]
