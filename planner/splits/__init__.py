"""Split searches: the candidate plans of a configuration; see :mod:`planner.search.driver` for the map."""
