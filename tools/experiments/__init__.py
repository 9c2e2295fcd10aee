"""Experiment drivers (each one ``python -m tools.experiments.<name>``); the shared run machinery is
:mod:`tools.runs`."""
