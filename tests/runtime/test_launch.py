"""The torchrun command line the launcher builds."""

from __future__ import annotations

from runtime.launch import Rendezvous, torchrun_argv


def test_single_host_uses_a_free_port() -> None:
    argv = torchrun_argv(["--plan", "p.json"], nproc_per_node=2, rendezvous=Rendezvous())
    assert argv[:3] == ["--standalone", "--nnodes", "1"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[argv.index("--max-restarts") + 1] == "0"
    assert argv[-4:] == ["--module", "runtime.worker", "--plan", "p.json"]


def test_several_hosts_use_static_rendezvous() -> None:
    rdzv = Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
    argv = torchrun_argv([], nproc_per_node=4, rendezvous=rdzv)
    pairs = dict(zip(argv[::2], argv[1::2], strict=False))
    assert pairs["--nnodes"] == "2" and pairs["--node-rank"] == "1" and pairs["--rdzv-backend"] == "static"
    assert pairs["--master-addr"] == "10.0.0.1" and pairs["--master-port"] == "29400"
    assert "--standalone" not in argv


def test_torchrun_accepts_the_command_line() -> None:
    from torch.distributed import run as torchrun

    rdzv = Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
    args = torchrun.parse_args(torchrun_argv(["--steps", "3"], nproc_per_node=4, rendezvous=rdzv))
    assert args.module and args.training_script == "runtime.worker" and args.training_script_args == ["--steps", "3"]
    assert args.node_rank == 1 and args.master_addr == "10.0.0.1" and args.nproc_per_node == "4"


def test_no_worker_flag_is_taken_by_torchrun() -> None:
    """torchrun's parser reads abbreviations even after the module name: a worker flag that is
    the start of one of its options (``--log`` of ``--log-dir``) would stop the launch."""
    import argparse

    from torch.distributed import run as torchrun

    from runtime.worker import add_worker_args

    worker = argparse.ArgumentParser()
    add_worker_args(worker)
    ours = [o for a in worker._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    theirs = [o for a in torchrun.get_args_parser()._actions for o in a.option_strings if o.startswith("--")]  # type: ignore[no-untyped-call]
    clashes = sorted({o for o in ours for t in theirs if t.startswith(o)})
    assert not clashes, clashes
    flags = ["--steps", "3", "--log-file", "x.csv", "--lr-schedule", "cosine", "--warmup-steps", "2",
             "--clip-grad-norm", "1.0", "--dtype", "bfloat16", "--min-lr", "0.0"]  # fmt: skip
    args = torchrun.parse_args(torchrun_argv(flags, nproc_per_node=2, rendezvous=Rendezvous()))
    assert args.training_script_args == flags
