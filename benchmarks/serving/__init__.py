"""The scripts behind docs/results/serving/."""
