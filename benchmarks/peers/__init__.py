"""The scripts behind docs/results/peers/."""
