"""The scripts behind docs/results/reliability/."""
