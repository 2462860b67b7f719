"""The scripts behind docs/results/simulation/."""
