"""The scripts behind docs/results/testing/."""
