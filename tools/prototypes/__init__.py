"""Prototypes: designs measured before they are built into fedguard (``shard_prototype``)."""
