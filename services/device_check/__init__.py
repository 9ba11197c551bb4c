"""The GPU device check (`make gpu-check`): the engine alone on a lent accelerator, and the step driver that
feeds an engine hand-built steps (engine tests use it too). Not a benchmark: it passes or fails."""
