"""The skill library wing: what a skill is, where skills live, and which ones a turn gets.

- :mod:`~metaclaw.skills.library`: the ``SKILL.md`` format, the versioned library kept in the
  store, and the operations that change it;
- :mod:`~metaclaw.skills.asks`: what the user actually asked, read from a request (the query);
- :mod:`~metaclaw.skills.retrieval`: scoring skills for a query, the skill block and its injection;
- :mod:`~metaclaw.skills.static_embedding`: the packaged static MiniLM table (``data/``);
- ``starter_skills/``: the skills shipped with the package.

May import: the shared modules at the top of the package (``metaclaw.store``,
``metaclaw.jsonlib``, ``metaclaw.turns``, ...). Never the proxy, the loops, the offline
stand-ins or the outer layers (checked by ``tests/test_architecture.py``).

``from metaclaw.skills import SkillLibrary`` (and ``Skill``, ``SkillOp``) keeps working: the
names are read from :mod:`~metaclaw.skills.library` when first used.
"""

_PUBLIC = {"SkillLibrary": "library", "Skill": "library", "SkillOp": "library"}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
