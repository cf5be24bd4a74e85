"""Lower bounds of the step time, one family per module (the map: :mod:`planner.search.driver`).

Every bound is valid for every split of its configuration and is checked against exhaustive
search by property tests (``tests/planner/test_bounds.py``, ``tests/planner/test_chain_dp.py``).
"""
