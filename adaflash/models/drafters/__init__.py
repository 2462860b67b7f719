"""The drafters beside a target: the DFlash block-diffusion drafter (dflash.py, with DFlash 2's additions in
dflash2.py), its configuration and checkpoints in the public schema, its trimmed draft vocabulary, and the
candidate-length heads that ride with it."""
