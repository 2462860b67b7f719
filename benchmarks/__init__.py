"""One-off measurement scripts, run from the repository root as `python benchmarks/NAME.py`; not part of the package.

A package only so that tests (and the A/B scripts beside results) can import a script's functions:
`from benchmarks.step_profile import profile_generation`. The adaflash package never imports from here.
"""
