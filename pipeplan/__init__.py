"""pipeplan's command line: ``pipeplan profile|synth|estimate|plan|serve|run|show|schema``.

Each subcommand lives in its own ``cmd_<name>.py`` module with a ``register(subparsers)``
function; modules import nothing heavy (torch, ortools, fastapi) until their command runs.
"""
