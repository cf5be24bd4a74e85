"""The model zoo: small, seeded PyTorch models with no-argument entry points.

* ``examples.hf`` -- Hugging Face transformers models from tiny configurations (needs the
  ``models`` extra): ``gpt2``, ``llama``, ``qwen2``, ``mixtral`` (MoE), ``bert``, ``t5``, ``vit``,
  with their default dropout, called with keyword arguments and returning ``ModelOutput``;
* ``examples.vision`` -- CNNs written as torchvision and timm write them: ``resnet``,
  ``mobilenet``, ``convnext`` (channels_last, stochastic depth), ``densenet``, ``googlenet``;

and the original dropout-free ones:

* ``examples.gpt:tiny`` / ``:small`` -- GPT-style decoder: ``ModuleList`` of blocks called
  with keyword arguments, LM head tied to the token embedding, cross-entropy loss;
  ``examples.gpt:tiny_with_data`` is ``tiny`` plus a data function (a toy token stream);
* ``examples.resnet:tiny`` / ``:small`` -- residual network with BatchNorm and downsampling
  shortcuts, nested ``Sequential`` stages, a cross-entropy loss;
* ``examples.amoebanet:tiny`` / ``:small`` -- cell network whose cells read the two previous
  outputs, plus skips spanning several cells.

The original three also have a config dataclass and ``build(config)`` for other sizes.
``examples/profiles/`` holds profiles: ``tiny.json`` (hand-written) and ``gpt-tiny-cpu.json``
(measured with ``pipeplan profile --model examples.gpt:tiny --threads 1``).
"""
