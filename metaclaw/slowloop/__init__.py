"""The slow loop wing: train the policy with GRPO while the user is away, and serve it.

- :mod:`~metaclaw.slowloop.loop`: the loop (sample, reward, train, publish, hot-swap);
- :mod:`~metaclaw.slowloop.grpo`: GRPO itself, readable top to bottom;
- :mod:`~metaclaw.slowloop.policy`: serving chat completions from the current trained policy;
- :mod:`~metaclaw.slowloop.causal_lm`: loading a real causal LM offline;
- :mod:`~metaclaw.slowloop.backends`: the training backends (local torch + peft, Tinker);
- :mod:`~metaclaw.slowloop.scheduler`: when the user is idle enough to train.

May import: the shared modules, :mod:`metaclaw.skills`, :mod:`metaclaw.protocols`,
:mod:`metaclaw.proxy` and :mod:`metaclaw.fastloop`. Never the offline stand-ins or the outer
layers (checked by ``tests/test_architecture.py``).
"""

#: The defaults of ``metaclaw train`` and ``%metaclaw train``: LoRA on a real model (the
#: library's own :class:`~metaclaw.slowloop.grpo.GRPOConfig` defaults suit the tiny offline
#: model of the tests and tutorials, which pass their own).
TRAIN_DEFAULTS = {"steps": 20, "group_size": 8, "groups_per_step": 4, "max_tokens": 256,
                  "learning_rate": 4e-5}
