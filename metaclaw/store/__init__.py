"""The workspace store: everything MetaClaw records, in one SQLite file (WAL mode, the embedded
default that needs nothing) or one PostgreSQL database (a team's workspace shared by processes
on several machines: :mod:`metaclaw.store.postgres`). ``Store(target)`` picks the engine from
``target`` (:func:`parse_target`): a path or ``sqlite:///path`` opens SQLite, a
``postgresql://`` URL PostgreSQL; both serve the same schema, migrations and methods.

Tables (schema version in ``PRAGMA user_version``; migrations are explicit, in ``MIGRATIONS``):

- ``sessions``               one row per agent session (``X-Session-Id``)
- ``turns``                  one row per proxied chat request: what was sent upstream (after skill
                             injection), the reply, tool calls, usage, latency, status, the skill
                             generation and policy version that served it, the judge's verdict, and
                             the turn's place in the support / query buffers
- ``skill_generations``      one row per version of the skill library (full snapshot, parent)
- ``skill_events``           one row per add / edit / remove operation, with evidence turn ids
- ``policy_versions``        one row per published set of trained weights
- ``training_steps``         one row per GRPO step
- ``scheduler_transitions``  one row per scheduler state change, with the process it came from
- ``events``                 one row per notable event of a loop (a judge or evolver call that
                             failed, a broken skill file, a generation adopted from another
                             process), with its source, level, message and details
- ``labels``                 one row per human label of a turn (pass / fail, note, corrected
                             answer, author, time); the latest verdict is also ``turns.human_label``
- ``proposals``              one row per skill change reviewed by the verification gate: held
                             back or promoted, with its per-case evidence and who decided
- ``datasets``               one row per named selection of turns (:mod:`metaclaw.fastloop.experiments`)
- ``experiments``            one row per experiment: its dataset, its variants, its settings
- ``experiment_results``     one row per case and variant of an experiment: the judged replay
- ``skill_folders``          one row per skill folder of each machine: the generation its files
                             were last brought to (see :mod:`metaclaw.skills.library`)
- ``proxy_activity``         one row per proxy process: the last time it had a request in flight
                             (written every few seconds while it has one; the scheduler's proxy
                             signal reads it), dropped when the proxy stops

Every write is committed before the call returns (``synchronous=FULL``: fsynced, so it survives
``kill -9`` of the process, an OS crash and a power loss). ``transaction(fsync=False)`` commits
without the fsync (``synchronous=NORMAL``, SQLite's recommendation for WAL): the commit is
atomic and in the operating system's hands when it returns, so it survives ``kill -9`` of the
process, but an OS crash or power loss may roll back the last such commits (never corrupting the
file); the proxy records turns this way unless told otherwise. One connection is shared behind a
lock; every table is readable as a ``polars.DataFrame`` with :meth:`Store.frame`. JSON columns are
written with orjson (:mod:`metaclaw.jsonlib`).

May import: the shared modules it is built on (:mod:`metaclaw.jsonlib`, :mod:`metaclaw.progress`,
:mod:`metaclaw.redact`). Never a wing or an outer layer: the store is itself a shared module,
which every wing may import (checked by ``tests/test_architecture.py``).
"""

from metaclaw.store.base import (  # noqa: F401  the store's public names
    BUSY_TIMEOUT_S, DB_ERRORS, DEFAULT_DB, ENGINES, EVENT_LEVELS, IN_IDS, JSON_COLUMNS, MIGRATIONS,
    SCHEMA_VERSION, TABLES, EngineError, OutageLog, Store, StoreBusy, StoreError,
    StoreUnavailable,
    default_target, id_list,
    local_dir, lock_busy, parse_target, this_process, workspace_exists,
)


def _postgres() -> type:
    from metaclaw.store.postgres import PostgresStore

    return PostgresStore


ENGINES["postgresql"] = _postgres
