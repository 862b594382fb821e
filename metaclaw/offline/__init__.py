"""The offline stand-ins: what runs MetaClaw with no model, no key and no network.

Code a newcomer can skip: nothing in the core imports it.

- :mod:`~metaclaw.offline.double`, :mod:`~metaclaw.offline.double_anthropic`: test and demo
  doubles of an OpenAI and an Anthropic server (not models);
- :mod:`~metaclaw.offline.simmodel`, :mod:`~metaclaw.offline.simrules`: the SIMULATED model of
  the demo and the rules it can follow;
- :mod:`~metaclaw.offline.localmodel`: a real small language model behind the OpenAI chat API;
- :mod:`~metaclaw.offline.tinymodel`: a tiny causal LM built locally from a config;
- :mod:`~metaclaw.offline.research_pipeline`: a simulated multi-stage research pipeline.

May import: every wing below the outer layers (skills, protocols, proxy, fast and slow loop).
Never the outer layers (CLI, notebook, bench, demo, runtime) (checked by
``tests/test_architecture.py``).
"""
