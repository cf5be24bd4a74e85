"""One router per resource: plans, estimate, presets, health."""
