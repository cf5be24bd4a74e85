"""The profile summary table (torch-free: ``pipeplan synth`` prints it too).

For a measured profile it also says how well each time is known (``metadata.profiler`` from
:mod:`profiler.measure`): the relative error of each layer's median, a flag on layers whose
median missed the target within the time budget (``unstable``) and on layers faster than the
timer's useful resolution (``< timer``), with a note after the table saying what to do.
"""

from __future__ import annotations

from typing import Any

from planner.schema import Profile


def _timing(profile: Profile) -> dict[str, Any]:
    meta = profile.metadata.get("profiler")
    return meta if isinstance(meta, dict) else {}


def layer_flags(profile: Profile, size: int) -> dict[str, str]:
    """Per layer name, its flag at micro-batch ``size``: ``"< timer"`` or ``"unstable"``."""
    meta = _timing(profile)
    flags: dict[str, str] = {}
    for key, flag in (("unstable", "unstable"), ("below_resolution", "< timer")):
        table = meta.get(key)
        names = table.get(str(size)) if isinstance(table, dict) else None
        for name in names if isinstance(names, list) else []:
            if isinstance(name, str):
                flags[name] = flag  # below the timer's resolution wins: more repeats would not help
    return flags


def median_errors(profile: Profile, size: int) -> list[float | None]:
    """Per layer, the relative error of its median at ``size`` (``None`` when not recorded)."""
    table = _timing(profile).get("median_error")
    values = table.get(str(size)) if isinstance(table, dict) else None
    if not isinstance(values, list) or len(values) != profile.num_layers:
        return [None] * profile.num_layers
    return [float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None for v in values]


def summary_notes(profile: Profile) -> list[str]:
    """What the flags mean for this profile, and the fix (one line per kind of flag)."""
    meta = _timing(profile)
    sizes = profile.microbatch_sizes
    out = []
    repeats = meta.get("repeats")
    adaptive = meta.get("adaptive")
    unstable = meta.get("unstable")
    if isinstance(unstable, dict) and unstable and isinstance(adaptive, dict):
        names = sorted({n for v in unstable.values() if isinstance(v, list) for n in v if isinstance(n, str)})
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        target = adaptive.get("target_error")
        budget = adaptive.get("time_budget_s")
        at = ", ".join(
            f"{r} at micro-batch {b}"
            for b, r in zip(sizes, repeats if isinstance(repeats, list) else [], strict=False)
            if str(b) in unstable
        )
        target_text = f"{target:.0%}" if isinstance(target, int | float) else "the target"
        budget_text = f"{budget:g} s" if isinstance(budget, int | float) else "the time budget"
        out.append(
            f"{len(names)} layer(s) did not reach a median within ±{target_text} in the {budget_text} budget "
            f"({at} repeats): {shown}; the machine is noisy for them: profile with --time-budget "
            f"{2 * budget if isinstance(budget, int | float) else 60:g}, on a quieter machine, or with --clock cpu --threads 1"
        )
    tiny = meta.get("below_resolution")
    timer = meta.get("timer")
    if isinstance(tiny, dict) and tiny:
        names = sorted({n for v in tiny.values() if isinstance(v, list) for n in v if isinstance(n, str)})
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        useful = timer.get("useful_ms") if isinstance(timer, dict) else None
        res = f" ({useful:.4f} ms)" if isinstance(useful, int | float) else ""
        out.append(
            f"{len(names)} layer(s) run faster than the timer's useful resolution{res}: {shown}; their times are "
            "mostly the timer's own cost: join them into larger layers (--split-points) or profile a larger micro-batch"
        )
    return out


def print_summary(profile: Profile, *, max_rows: int = 20) -> None:
    """A table of the profile (largest micro-batch size), on stderr; long models abridged."""
    from rich.console import Console
    from rich.table import Table

    from planner.units import format_bytes

    k = len(profile.microbatch_sizes) - 1
    b = profile.microbatch_sizes[k]
    m = profile.measured_on
    threads = f", {m.num_threads} threads" if m.num_threads else ""
    meta = _timing(profile)
    repeats = meta.get("repeats")
    runs = ""
    if isinstance(repeats, list) and len(repeats) == len(profile.microbatch_sizes):
        runs = f", {repeats[k]} timed steps" + (" (adaptive)" if isinstance(meta.get("adaptive"), dict) else "")
    table = Table(
        title=f"{profile.model}: {profile.num_layers} layers, micro-batch {b}, {m.device} {m.dtype}{threads}{runs}"
    )
    cuda = any(layer.peak_memory_bytes for layer in profile.layers)
    flags = layer_flags(profile, b)
    errors = median_errors(profile, b)
    show_error = any(e is not None for e in errors)
    cols = ["layer", "params", "fwd ms", "bwd ms", "± (IQR)"]
    cols += ["median ±"] if show_error else []
    cols += ["activations", "cut bytes"]
    cols += ["CUDA peak"] if cuda else []
    cols += ["flag"] if flags else []
    for col in cols:
        table.add_column(col, justify="left" if col in ("layer", "flag") else "right")
    rows = list(enumerate(profile.layers))
    hidden = 0
    if len(rows) > max_rows:
        hidden = len(rows) - max_rows
        rows = rows[: max_rows // 2] + rows[-(max_rows - max_rows // 2) :]
    for j, (i, layer) in enumerate(rows):
        if hidden and j == max_rows // 2:
            table.add_row(f"... {hidden} more", *[""] * (len(table.columns) - 1), style="dim")
        spread = ""
        if layer.forward_ms_spread is not None and layer.backward_ms_spread is not None:
            spread = f"{layer.forward_ms_spread[k]:.3f}/{layer.backward_ms_spread[k]:.3f}"
        cells = [
            layer.name,
            format_bytes(layer.param_bytes),
            f"{layer.forward_ms[k]:.3f}",
            f"{layer.backward_ms[k]:.3f}",
            spread,
        ]
        if show_error:
            e = errors[i]
            cells.append("" if e is None else f"{e:.1%}")
        cells += [format_bytes(layer.activation_bytes[k]), format_bytes(layer.transfer_bytes()[k])]
        if cuda:
            cells.append(format_bytes(layer.peak_memory_bytes[k]) if layer.peak_memory_bytes else "")
        if flags:
            cells.append(flags.get(layer.name, ""))
        table.add_row(*cells, style="yellow" if layer.name in flags else None)
    total_f = sum(layer.forward_ms[k] for layer in profile.layers)
    total_b = sum(layer.backward_ms[k] for layer in profile.layers)
    total = [
        "total",
        format_bytes(sum(layer.param_bytes for layer in profile.layers)),
        f"{total_f:.3f}",
        f"{total_b:.3f}",
        "",
        *([""] if show_error else []),
        format_bytes(sum(layer.activation_bytes[k] for layer in profile.layers)),
    ]
    table.add_row(*total, *[""] * (len(table.columns) - len(total)), style="bold")
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=140)
    console.print(table)
    for note in summary_notes(profile):
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
