"""The fast loop wing: judge the recorded turns, evolve the skills, gate what goes live.

- :mod:`~metaclaw.fastloop.loop`: the background loop (judge new turns, keep the buffers, evolve);
- :mod:`~metaclaw.fastloop.judge`: the PRM judge;
- :mod:`~metaclaw.fastloop.evolver`: an LLM turns judged failures into changes to the library;
- :mod:`~metaclaw.fastloop.gate`: an automatic change goes live only when safe and better;
- :mod:`~metaclaw.fastloop.proposals`: the changes the gate held back, and every promotion;
- :mod:`~metaclaw.fastloop.labels`: a person's verdicts on turns;
- :mod:`~metaclaw.fastloop.llm`: the LLM client with retries that the judge, evolver, gate and
  replay share;
- :mod:`~metaclaw.fastloop.replay`: a recorded turn replayed with other skills and judged (the
  gate, the evolver's verification and experiments replay through it);
- :mod:`~metaclaw.fastloop.evidence`: per-skill evidence from the recorded turns;
- :mod:`~metaclaw.fastloop.experiments`: datasets of turns replayed with several variants.

May import: the shared modules, :mod:`metaclaw.skills`, :mod:`metaclaw.protocols` and
:mod:`metaclaw.proxy`. Never the slow loop, the offline stand-ins or the outer layers (checked by
``tests/test_architecture.py``).
"""
