"""Registers the real and file-based datasets (imported once by :mod:`fedcore.data`)."""

from fedcore.data import cifar10, files, har, mnist, shakespeare

__all__ = ["cifar10", "files", "har", "mnist", "shakespeare"]
