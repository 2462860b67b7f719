"""Measurement scripts, run from the repository root as `python benchmarks/TOPIC/NAME.py`; not part of the package.

One folder a topic, as docs/results/ has them (runtime, serving, drafter, adaflash, simulation, reliability, peers,
testing): a result's script sits in the folder of the same name as its page. results_tables.py writes the tables of
every folder.
A package only so that tests (and scripts) can import a script's functions:
`from benchmarks.runtime.step_profile import profile_generation`. The adaflash package never imports from here.
"""
