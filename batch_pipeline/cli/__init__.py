"""The command line, the top layer: `batch-pipeline` (main.py) and the commands that need a module
of their own, `doctor` (doctor.py) and `model list / checksum / verify / use / rollback`
(model_commands.py). Each command calls an entry point of a layer below it."""
