"""Environments for multi-turn episodes (docs/agents.md): the ``Environment`` contract and its ``Turn``,
the episode loop, the ``tools`` environment and its sandboxed Python tool, the embedded ``reveal`` task."""

from gcore.envs.base import Environment, SingleTurn, Turn

__all__ = ["Environment", "SingleTurn", "Turn"]
