"""The model zoo: small, seeded, dropout-free PyTorch models with no-argument entry points.

* ``examples.gpt:tiny`` / ``:small`` -- GPT-style decoder: ``ModuleList`` of blocks called
  with keyword arguments, LM head tied to the token embedding, cross-entropy loss;
  ``examples.gpt:tiny_with_data`` is ``tiny`` plus a data function (a toy token stream);
* ``examples.resnet:tiny`` / ``:small`` -- residual network with BatchNorm and downsampling
  shortcuts, nested ``Sequential`` stages, a cross-entropy loss;
* ``examples.amoebanet:tiny`` / ``:small`` -- cell network whose cells read the two previous
  outputs, plus skips spanning several cells.

Each module also has a config dataclass and ``build(config)`` for other sizes.
``examples/profiles/`` holds profiles: ``tiny.json`` (hand-written) and ``gpt-tiny-cpu.json``
(measured with ``pipeplan profile --model examples.gpt:tiny --threads 1``).
"""
