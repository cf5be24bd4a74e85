"""The search for a plan: configuration space, split model, search state, driver.

Start at :mod:`planner.search.driver`: its doc describes the method and maps every module of
``planner/search``, ``planner/bounds`` and ``planner/splits``.
"""
