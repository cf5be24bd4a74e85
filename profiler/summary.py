"""The profile summary table (torch-free: ``pipeplan synth`` prints it too)."""

from __future__ import annotations

from planner.schema import Profile


def print_summary(profile: Profile, *, max_rows: int = 20) -> None:
    """A table of the profile (largest micro-batch size), on stderr; long models abridged."""
    from rich.console import Console
    from rich.table import Table

    from planner.units import format_bytes

    k = len(profile.microbatch_sizes) - 1
    b = profile.microbatch_sizes[k]
    m = profile.measured_on
    threads = f", {m.num_threads} threads" if m.num_threads else ""
    table = Table(title=f"{profile.model}: {profile.num_layers} layers, micro-batch {b}, {m.device} {m.dtype}{threads}")
    cuda = any(layer.peak_memory_bytes for layer in profile.layers)
    cols = ["layer", "params", "fwd ms", "bwd ms", "± (IQR)", "activations", "cut bytes"]
    for col in [*cols, "CUDA peak"] if cuda else cols:
        table.add_column(col, justify="left" if col == "layer" else "right")
    layers = list(profile.layers)
    hidden = 0
    if len(layers) > max_rows:
        hidden = len(layers) - max_rows
        layers = layers[: max_rows // 2] + layers[-(max_rows - max_rows // 2) :]
    for i, layer in enumerate(layers):
        if hidden and i == max_rows // 2:
            table.add_row(f"... {hidden} more", *[""] * (len(table.columns) - 1), style="dim")
        spread = ""
        if layer.forward_ms_spread is not None and layer.backward_ms_spread is not None:
            spread = f"{layer.forward_ms_spread[k]:.3f}/{layer.backward_ms_spread[k]:.3f}"
        table.add_row(
            layer.name,
            format_bytes(layer.param_bytes),
            f"{layer.forward_ms[k]:.3f}",
            f"{layer.backward_ms[k]:.3f}",
            spread,
            format_bytes(layer.activation_bytes[k]),
            format_bytes(layer.transfer_bytes()[k]),
            *([format_bytes(layer.peak_memory_bytes[k]) if layer.peak_memory_bytes else ""] if cuda else []),
        )
    total_f = sum(layer.forward_ms[k] for layer in profile.layers)
    total_b = sum(layer.backward_ms[k] for layer in profile.layers)
    table.add_row(
        "total",
        format_bytes(sum(layer.param_bytes for layer in profile.layers)),
        f"{total_f:.3f}",
        f"{total_b:.3f}",
        "",
        format_bytes(sum(layer.activation_bytes[k] for layer in profile.layers)),
        *[""] * (len(table.columns) - 6),
        style="bold",
    )
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=120)
    console.print(table)
