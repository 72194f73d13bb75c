"""Environments for multi-turn episodes (docs/agents.md)."""
