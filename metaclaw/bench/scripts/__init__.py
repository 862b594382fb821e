"""The benchmark's checker commands (``python -m metaclaw.bench.scripts.check_iso8601 ...``).

A round's ``python scripts/check_*.py`` command is rewritten to run these modules, which live in
the installed package, outside the agent's writable workspace.

May import: :mod:`metaclaw.bench.graders` and the standard library alone, so that a check starts
fast (checked by ``tests/test_architecture.py``).
"""
