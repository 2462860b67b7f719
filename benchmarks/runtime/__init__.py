"""The scripts behind docs/results/runtime/."""
