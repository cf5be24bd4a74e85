"""The schedule's loss is never a view (``runtime.loop.own_loss``): torch's split-backward
schedules (ZB-H1, ZBV) detach it in place after the input gradients, which a view refuses, and
the vocabulary-parallel loss (``runtime.mesh.vocab_parallel_loss``) is one.  End to end:
``llama-D1-T2-K2-zb-h1-*`` in ``tests/runtime/test_matrix.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F


@pytest.fixture
def one_rank(tmp_path: Path):  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_vocabulary_parallel_loss_survives_a_split_backward(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.distributed.tensor import DTensor, Shard

    from runtime.loop import own_loss
    from runtime.mesh import MeshSpec, loss_parallel_context, vocab_parallel_loss

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    x0, w = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8, 16))
    target = torch.tensor([0, 3, 5, 15])

    x = x0.clone().requires_grad_(True)
    with loss_parallel_context(MeshSpec(tensor_parallel_degree=2)):
        logits = DTensor.from_local(x @ w, mesh, [Shard(1)])  # the head's logits, sharded on the vocabulary
        value, sharded = vocab_parallel_loss(lambda o: F.cross_entropy(o, target), logits)
        assert sharded
        loss = own_loss(value)
        assert not loss._is_view()
        # ZB-H1's backward: the input gradients first (then the loss is detached in place), the
        # weight gradients later
        dinputs, groups = stage_backward_input([loss], None, [x], iter([w]))
        stage_backward_weight(iter([w]), groups)

    ref_x = x0.clone().requires_grad_(True)
    ref_w = w.detach().clone().requires_grad_(True)
    F.cross_entropy(ref_x @ ref_w, target).backward()
    assert torch.allclose(value.detach(), F.cross_entropy(x0 @ w.detach(), target))
    assert ref_x.grad is not None and ref_w.grad is not None and w.grad is not None
    assert torch.allclose(dinputs[0], ref_x.grad, atol=1e-6) and torch.allclose(w.grad, ref_w.grad, atol=1e-6)


def test_a_loss_that_is_not_a_view_is_kept() -> None:
    from runtime.loop import own_loss

    loss = (torch.ones(3, requires_grad=True) * 2).sum()
    assert own_loss(loss) is loss and own_loss(1.5) == 1.5
