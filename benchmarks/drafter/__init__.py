"""The scripts behind docs/results/drafter/."""
