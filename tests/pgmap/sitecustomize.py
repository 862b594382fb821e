"""Child processes of the suite's PostgreSQL run open the same databases as the tests: on the
PYTHONPATH only while ``--store-engine postgresql`` runs (see ``tests/pgcluster.py``)."""

import os
import sys

if os.environ.get("METACLAW_TEST_PG_SOCKET"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pgcluster

    pgcluster.map_paths(os.environ["METACLAW_TEST_PG_SOCKET"])
