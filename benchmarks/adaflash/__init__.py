"""The scripts behind docs/results/adaflash/."""
