"""Experiment drivers (``python tools/experiments/<name>.py``, or ``python -m tools.experiments.<name>``); the shared
run machinery is :mod:`tools.runs`."""
