"""Runtime: execute a plan on torch.distributed.pipelining (``pipeplan run``).

``runtime.worker`` is the torchrun entry module (one rank; its docstring names the module of
each part of a rank's run); ``runtime.launch`` starts the ranks and diagnoses failures (its parts ``launch_command``
and ``launch_failure``);
``runtime.plan_check``, ``runtime.faults`` and ``runtime.report`` are torch-free.  Importing
this package imports nothing heavy.
"""
