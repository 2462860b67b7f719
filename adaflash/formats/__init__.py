"""File formats that the serving engine writes and training reads: on-policy trajectories (`trajectories.py`)
and recorded verification outcomes (`outcomes.py`); and the verification traces the simulator replays (`traces.py`); the JSON-lines files two of them are (`json_lines.py`).

They sit just above `adaflash.models` (outcomes use its safetensors reader), below everything that writes or
reads them, so the serving recorder and the trainers share them without the engine importing training code.
"""
