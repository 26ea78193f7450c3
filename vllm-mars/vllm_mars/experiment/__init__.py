"""Experiment grids: ``mars experiment run FILE`` (spec: the TOML file; grid: the run; results: the
paper's table and plots). See ``experiments/README.md`` at the repository root."""
